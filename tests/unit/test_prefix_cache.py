"""The prefix cache: longest block-aligned prefix found by its chain digests, LRU within a byte
budget; and on every backend, a restored prefix continues exactly as a fresh prefill would."""

from __future__ import annotations

import pytest
import torch

from specdec.prefix_cache import PrefixCache
from tests.conftest import gguf_copy

PROMPT = [(7 * i + 3) % 90 + 2 for i in range(45)]


def test_the_longest_cached_block_aligned_prefix_is_found():
    cache = PrefixCache(budget_bytes=1000, block=4)
    assert cache.insert(PROMPT[:12], "a", 10)
    assert cache.insert(PROMPT[:8] + [1, 1, 1, 1, 1], "b", 10)  # shares 8 tokens with "a"
    assert cache.lookup(PROMPT) == (12, "a")
    assert cache.lookup(PROMPT[:10]) == (8, "b")  # both hold 8 of them: the newest answers
    assert cache.lookup(PROMPT, at_most=11) == (8, "b")
    assert cache.lookup([99] + PROMPT) == (0, None)
    assert cache.lookup(PROMPT[:3]) == (0, None)  # shorter than a block
    assert cache.stats.hits == 12 + 8 + 8


def test_entries_already_covered_too_short_or_too_large_are_not_kept():
    cache = PrefixCache(budget_bytes=100, block=4)
    assert cache.insert(PROMPT[:12], "a", 10)
    assert not cache.insert(PROMPT[:8], "shorter", 10)  # every prefix of it is found already
    assert not cache.insert(PROMPT[:3], "tiny", 1)
    assert not cache.insert(PROMPT[:20], "huge", 101)
    assert len(cache) == 1 and cache.bytes_held == 10


def test_least_recently_used_entries_go_first_and_their_prefixes_stay_served_by_others():
    cache = PrefixCache(budget_bytes=30, block=4)
    cache.insert(PROMPT[:8], "old", 10)
    cache.insert(PROMPT[:16], "longer", 10)
    cache.insert([5] * 8, "other", 10)
    cache.lookup([5] * 8)  # used: now the most recent
    cache.insert([6] * 8, "new", 10)  # over budget: the least recently used ("old") goes
    assert cache.stats.evictions == 1 and cache.bytes_held == 30
    assert cache.lookup(PROMPT[:8]) == (8, "longer")
    cache.insert([7] * 8, "newer", 10)  # "longer" was just used: "other" goes
    assert cache.lookup([5] * 8) == (0, None) and cache.lookup(PROMPT) == (16, "longer")


def _backends(tiny_target, tmp_path_factory):
    from specdec.fast import FastLlamaLM

    return {"hf": tiny_target, "fast": FastLlamaLM(tiny_target.model, name="tiny-fast"),
            "llamacpp": gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "t.gguf", context=256)}


@pytest.fixture(scope="module")
def backends(tiny_target, tmp_path_factory):
    return _backends(tiny_target, tmp_path_factory)


def _continue(lm, cache, rest: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill `rest` on the cache, then greedy steps: -> (the logits after rest, the tokens)."""
    logits = lm.prefill(cache, [rest]).logits[0]
    first, out = logits, []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = lm.forward(cache, torch.tensor([[out[-1]]])).logits[0, -1]
    return first, out


@pytest.mark.parametrize("name", ["hf", "fast", "llamacpp"])
def test_a_restored_prefix_continues_as_a_fresh_prefill(backends, name):
    lm = backends[name]
    fresh_logits, fresh = _continue(lm, lm.new_cache(1), PROMPT, 12)
    donor = lm.new_cache(1)
    lm.prefill(donor, [PROMPT[:40]])
    snapshot, nbytes = lm.snapshot_prefix(donor, 40)
    assert nbytes > 0
    cache = lm.new_cache(1)
    lm.restore_prefix(cache, snapshot, 32)  # fewer tokens than the snapshot holds
    assert int(cache.lengths[0]) == 32
    logits, tokens = _continue(lm, cache, PROMPT[32:], 12)
    assert tokens == fresh
    gap = float((logits - fresh_logits).abs().max())
    # torch: the very keys and values, so the same logits (up to the rounding of a 13- vs a 45-token
    # forward); llama.cpp: its kernels depend on the forward's token count (its tie tolerance).
    assert gap < (0.05 if name == "llamacpp" else 1e-4), gap
