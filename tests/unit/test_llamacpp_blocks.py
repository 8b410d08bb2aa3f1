"""Blocks as llama.cpp runs them: tree masks -> parents, and the kept branch (pure)."""

import pytest
import torch

from specdec.backends.llamacpp.blocks import NotATree, block_parents, depths_of, kept_path_end
from specdec.tree import block_mask


def test_a_missing_mask_is_a_chain():
    assert block_parents(None, 4) == [-1, 0, 1, 2]


def test_a_tree_mask_gives_back_its_parents():
    parents = [-1, 0, 0, 1, 1, 2]  # root; two children; the first has two, the second one
    mask = block_mask(tuple(p - 1 for p in parents[1:]))  # specdec.tree's drafted-node parents
    assert block_parents(mask, len(parents)) == parents
    assert depths_of(parents) == [0, 1, 1, 2, 2, 2]


def test_a_mask_that_is_not_a_tree_is_refused():
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)  # input 2 skips the root
    with pytest.raises(NotATree):
        block_parents(mask, 3)
    two_roots = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    with pytest.raises(NotATree):
        block_parents(two_roots, 2)


def test_the_kept_branch_ends_at_its_deepest_input():
    parents = [-1, 0, 0, 1, 1, 2]
    assert kept_path_end(parents, [True, True, False, False, True, False]) == 4
    assert kept_path_end(parents, [True, False, False, False, False, False]) == 0
    assert kept_path_end(parents, [False] * 6) == -1


def test_kept_inputs_scattered_over_branches_are_refused():
    with pytest.raises(ValueError, match="not one path"):
        kept_path_end([-1, 0, 0, 1], [True, True, True, False])
