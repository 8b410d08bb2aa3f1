"""The validity-masked KV cache: rollback, per-row keeps, compaction, all against recomputation."""

import torch

from tests.conftest import full_logits


def _feed(lm, cache, ids):
    return lm.forward(cache, torch.tensor([ids])).logits[0]


def test_rollback_then_refeed_matches_fresh_forward(tiny_target):
    lm = tiny_target
    cache = lm.new_cache(1)
    _feed(lm, cache, [3, 4, 5, 6])
    _feed(lm, cache, [7, 8, 9])  # a rejected draft
    cache.truncate(torch.tensor([4]))
    assert cache.lengths.tolist() == [4] and cache.num_slots == 4
    got = _feed(lm, cache, [10, 11])
    want = full_logits(lm, [3, 4, 5, 6, 10, 11])[-2:]
    assert torch.allclose(got, want, atol=1e-5)


def test_keep_last_drops_rejected_slots_per_row(tiny_target):
    lm = tiny_target
    cache = lm.new_cache(2)
    lm.prefill(cache, [[3, 4, 5], [6, 7, 8, 9]])
    lm.forward(cache, torch.tensor([[10, 11, 12], [13, 14, 15]]))
    cache.keep_last(torch.tensor([[True, False, False], [True, True, True]]))
    assert cache.lengths.tolist() == [4, 7]
    got = lm.forward(cache, torch.tensor([[20], [21]])).logits[:, -1]
    assert torch.allclose(got[0], full_logits(lm, [3, 4, 5, 10, 20])[-1], atol=1e-5)
    assert torch.allclose(got[1], full_logits(lm, [6, 7, 8, 9, 13, 14, 15, 21])[-1], atol=1e-5)


def test_tree_path_compaction_keeps_only_the_accepted_branch(tiny_target):
    """Nodes: root 5 -> a=6 -> c=8, and root -> b=7. Keeping root, b must look like the chain 5, 7."""
    from specdec.tree import block_mask, depths

    lm = tiny_target
    parents = (-1, 0, -1)  # 6 under root, 8 under 6, 7 under root
    cache = lm.new_cache(1)
    _feed(lm, cache, [2, 3, 4])
    ids = torch.tensor([[5, 6, 8, 7]])
    out = lm.forward(cache, ids, block_mask(parents)[None], depths(parents)[None]).logits[0]
    assert torch.allclose(out[2], full_logits(lm, [2, 3, 4, 5, 6, 8])[-1], atol=1e-5)
    assert torch.allclose(out[3], full_logits(lm, [2, 3, 4, 5, 7])[-1], atol=1e-5)
    cache.keep_last(torch.tensor([[True, False, False, True]]))
    assert cache.lengths.tolist() == [5]
    got = _feed(lm, cache, [9])[-1]
    assert torch.allclose(got, full_logits(lm, [2, 3, 4, 5, 7, 9])[-1], atol=1e-5)


def test_compact_squeezes_holes_without_changing_results(tiny_target):
    lm = tiny_target
    cache = lm.new_cache(2)
    lm.prefill(cache, [[3, 4], [5, 6, 7, 8, 9]])
    lm.forward(cache, torch.tensor([[10, 11], [12, 13]]))
    cache.keep_last(torch.tensor([[True, True], [False, False]]))
    before = lm.forward(cache, torch.tensor([[20], [21]])).logits[:, -1]
    cache.truncate(cache.lengths - 1)
    slots = cache.num_slots
    cache.compact()
    assert cache.num_slots == int(cache.lengths.max()) <= slots
    after = lm.forward(cache, torch.tensor([[20], [21]])).logits[:, -1]
    assert torch.allclose(before, after, atol=1e-5)


def test_select_rows_keeps_remaining_sequences(tiny_target):
    lm = tiny_target
    cache = lm.new_cache(3)
    lm.prefill(cache, [[3, 4], [5, 6, 7], [8]])
    cache.select_rows(torch.tensor([2, 0]))
    got = lm.forward(cache, torch.tensor([[9], [10]])).logits[:, -1]
    assert torch.allclose(got[0], full_logits(lm, [8, 9])[-1], atol=1e-5)
    assert torch.allclose(got[1], full_logits(lm, [3, 4, 10])[-1], atol=1e-5)
