"""Medusa-style trees as data: a list of paths compiled into parents, mask, depths and retrieve
indices, plus the greedy tree builder and its acceptance model."""

import dataclasses

import pytest
import torch

from specdec.tree import best_tree_for_cost, chain_tree, compile_tree, expected_accept_length, greedy_tree
from tests.conftest import quiet


def test_three_node_tree_compiles_by_hand():
    # Given out of order: head0 top-1, head0 top-2, and head1 top-1 under head0 top-1.
    tree = compile_tree([[1], [0, 0], [0]])
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree.parents == (-1, -1, 0)
    assert tree.head == (0, 0, 1)
    assert tree.rank == (0, 1, 0)
    want_mask = torch.tensor([
        [1, 0, 0, 0],  # root
        [1, 1, 0, 0],  # (0,)
        [1, 0, 1, 0],  # (1,)
        [1, 1, 0, 1],  # (0, 0): root, (0,), itself
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, want_mask)
    assert tree.depth.tolist() == [0, 1, 1, 2]
    # Leaves in node order: (1,) then (0, 0); block indices root..leaf, -1 padded.
    assert tree.retrieve.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert tree.top_needed() == 2 and tree.max_depth == 2


def test_chain_tree_is_a_chain():
    tree = compile_tree(chain_tree(3))
    assert tree.parents == (-1, 0, 1)
    assert torch.equal(tree.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.retrieve.tolist() == [[0, 1, 2, 3]]


def test_pruning_drops_deeper_nodes_only():
    tree = compile_tree([[0], [1], [0, 0], [0, 0, 0]])
    assert tree.pruned(1).paths == ((0,), (1,))
    assert tree.pruned(5) is tree


@pytest.mark.parametrize("paths, msg", [([[0, 0]], "no parent"), ([[0], [0]], "duplicate"),
                                        ([[]], "non-empty"), ([[-1]], "ranks >= 0")])
def test_malformed_paths_are_refused(paths, msg):
    with pytest.raises(ValueError, match=msg):
        compile_tree(paths)


def test_expected_accept_length_multiplies_along_paths():
    acc = [[0.5, 0.2], [0.4]]
    assert expected_accept_length([(0,), (1,), (0, 0)], acc) == pytest.approx(0.5 + 0.2 + 0.5 * 0.4)


def test_greedy_tree_takes_the_most_likely_nodes_first():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2], [0.3]]
    # values: (0,) .6, (0,0) .24, (1,) .2, (0,1) .12, (2,) .1, (1,0) .08, (0,0,0) .072
    assert greedy_tree(acc, 6) == [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)]
    tree = greedy_tree(acc, 7)
    assert (0, 0, 0) in tree
    compile_tree(tree)  # every greedy tree is a valid tree


@pytest.mark.parametrize("v3, expected", [(1.5, [(0,)]), (1.1, [(0,), (0, 0)])])
def test_tree_size_follows_the_verify_cost(v3, expected):
    # one node: 1.5 tokens per step at cost v(2) = 1; two: 1.75 at v(3): worth it only if v(3) < 1.167
    acc = [[0.5], [0.5]]
    assert best_tree_for_cost(acc, {1: 1.0, 2: 1.0, 3: v3}.__getitem__, max_nodes=2) == expected


def test_flat_cost_grows_the_tree_and_steep_cost_shrinks_it():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4], [0.3]]
    wide = best_tree_for_cost(acc, lambda m: 1.0, max_nodes=64)
    narrow = best_tree_for_cost(acc, lambda m: 1.0 + 0.25 * (m - 1), max_nodes=64)
    assert len(wide) == len(greedy_tree(acc, 64)) and len(narrow) <= 2


def test_auto_tree_is_measured_on_the_target_once(tiny_target):
    from specdec.costmodel import CostStore
    from specdec.medusa_heads import new_heads
    from specdec.proposers.medusa import resolve_tree

    heads = new_heads(tiny_target, num_heads=3, target_name="tiny")
    heads.config = dataclasses.replace(heads.config, accuracy=((0.5, 0.2), (0.4,), (0.3,)))
    measured = []
    costs = CostStore(notify=measured.append, others_busy=quiet)  # (a busy machine would add a line)
    paths = resolve_tree("auto", heads, tiny_target, costs)
    assert 1 <= len(paths) <= len(greedy_tree(heads.config.accuracy, 64))
    assert resolve_tree("auto", heads, tiny_target, costs) == paths
    assert len(measured) == 1  # the second choice reused the curve
