import torch

from specdec.tree import block_mask, chain_parents, depths, graft_chain, greedy_walk


def test_three_node_tree_mask_and_depths_by_hand():
    # root -> 0 -> 1, root -> 2
    parents = (-1, 0, -1)
    want = torch.tensor([
        [1, 0, 0, 0],  # root
        [1, 1, 0, 0],  # node 0: root, itself
        [1, 1, 1, 0],  # node 1: root, node 0, itself
        [1, 0, 0, 1],  # node 2: root, itself
    ], dtype=torch.bool)
    assert torch.equal(block_mask(parents), want)
    assert depths(parents).tolist() == [0, 1, 2, 1]


def test_chain_mask_is_causal():
    assert torch.equal(block_mask(chain_parents(3)), torch.ones(4, 4, dtype=torch.bool).tril())


def test_greedy_walk_follows_matching_children():
    tokens = (5, 6, 7, 8)
    parents = (-1, 0, -1, 2)  # 5 -> 6 ; 7 -> 8
    # target argmax per block index: root says 7, node0 (5) says 6, node1 says 0, node2 (7) says 8, node3 (8) says 9
    path, nxt = greedy_walk(tokens, parents, [7, 6, 0, 8, 9])
    assert path == [2, 3] and nxt == 9


def test_greedy_walk_rejects_at_root():
    path, nxt = greedy_walk((5, 6), None, [4, 6, 1])
    assert path == [] and nxt == 4


def test_graft_chain_follows_the_nodes_already_there_and_appends_the_rest():
    ids, parents = (5, 6, 9, 7), (-1, 0, 0, 1)  # root -> 5 -> {6 -> 7, 9}
    assert graft_chain(ids, parents, (5, 6, 8)) == ((5, 6, 9, 7, 8), (-1, 0, 0, 1, 1))  # shares 5 6
    assert graft_chain(ids, parents, (4, 6)) == ((5, 6, 9, 7, 4, 6), (-1, 0, 0, 1, -1, 4))  # a branch of its own
    assert graft_chain(ids, parents, (5, 9)) == (ids, parents)  # already in the tree
    assert graft_chain((1, 2), None, (1, 3)) == ((1, 2, 3), (-1, 0, 0))  # a chain becomes a tree
    walked, nxt = greedy_walk(*graft_chain(ids, parents, (4, 6)), target_argmax=[4, 0, 0, 0, 0, 6, 2])
    assert walked == [4, 5] and nxt == 2  # the target follows the grafted branch
