import torch

from specdec.tree import block_mask, chain_parents, depths, greedy_walk


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
