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
    # both hold the first block-aligned 8; "a" holds 2 more of these 10: reuse is exact to the token
    assert cache.lookup(PROMPT[:10]) == (10, "a")
    assert cache.lookup(PROMPT, at_most=11) == (11, "a")
    assert cache.lookup(PROMPT[:8] + [1, 1, 7]) == (10, "b")  # "b" shares 10 of these
    assert cache.lookup(PROMPT[:8] + [50]) == (8, "b")  # equals: the newest answers
    assert cache.lookup([99] + PROMPT) == (0, None)
    assert cache.lookup(PROMPT[:3]) == (0, None)  # shorter than a block
    assert cache.stats.hits == 12 + 10 + 11 + 10 + 8
    # whole blocks of 8 only (a llama.cpp target's prefill block): "a"'s 12 -> 8, "b"'s 10 -> 8
    assert cache.lookup(PROMPT, whole=8) == (8, "a") and cache.lookup(PROMPT[:8] + [1, 1, 7], whole=8) == (8, "b")
    assert cache.lookup(PROMPT, whole=16) == (0, None)


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
    from specdec.backends.fast import FastLlamaLM

    return {"hf": tiny_target, "fast": FastLlamaLM(tiny_target.model, name="tiny-fast"),
            "llamacpp": gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "t.gguf", context=256,
                                  n_batch=LLAMACPP_BLOCK)}


LLAMACPP_BLOCK = 16  # the llama.cpp copies' n_batch, and the block of the width-dependent rule


@pytest.fixture(scope="module")
def backends(tiny_target, tmp_path_factory):
    return _backends(tiny_target, tmp_path_factory)


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """The backends over a tiny target without an EOS token: answers run to their length."""
    from specdec.testing import tiny_llama

    return _backends(tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48, eos_token_id=None),
                     tmp_path_factory)


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


def test_a_llamacpp_prefix_moves_between_a_context_of_its_own_and_the_shared_one(tiny_target, tmp_path):
    """A target service's sessions live on contexts of their own or on sequences of the shared
    context (share_context): a prefix snapshotted on either is restored on the other and
    continues as a fresh prefill does."""
    from tests.conftest import gguf_copy

    lm = gguf_copy(tiny_target, tmp_path / "t.gguf", context=256)
    lm.share_context(4)
    fresh_logits, fresh = _continue(lm, lm.new_cache(1), PROMPT, 12)
    own = lm.new_cache(1)  # a lone cache: a context of its own
    lm.prefill(own, [PROMPT[:40]])
    slot = lm.new_cache(1)  # made while another is in use: a sequence of the shared context
    other_slot = lm.new_cache(1)  # (a second one, so the restored-into sequence is not sequence 0)
    assert own.shared is None and slot.shared in lm.shared and other_slot.shared in lm.shared
    snapshot, _ = lm.snapshot_prefix(own, 40)
    lm.restore_prefix(other_slot, snapshot, 32)
    logits, tokens = _continue(lm, other_slot, PROMPT[32:], 12)
    assert tokens == fresh and float((logits - fresh_logits).abs().max()) < 0.05
    back, _ = lm.snapshot_prefix(other_slot, 40)
    mine = lm.new_cache(1)
    del own, slot, other_slot
    assert mine.shared in lm.shared  # (others were in use when it was made)
    lone = type(mine)(lm, 1)  # a context of its own
    lm.restore_prefix(lone, back, 40)
    logits, tokens = _continue(lm, lone, PROMPT[40:], 12)
    assert tokens == fresh and float((logits - fresh_logits).abs().max()) < 0.05


@pytest.mark.parametrize("name", ["hf", "fast", "llamacpp"])
@pytest.mark.parametrize("method", ["plain", "prompt-lookup"])
def test_the_engine_reuses_earlier_prompts_and_answers_and_its_output_stays_plain(endless, name, method):
    """In process: a second call with the same start (a document asked about again) and a
    conversation's next turn (prompt + answer + more) prefill only what follows the cached
    prefix; every output equals plain decoding without a cache."""
    from specdec.decode import plain_generate
    from specdec.engine import Engine, EngineConfig
    from specdec.models import LoadedModel
    from specdec.types import StopConditions
    from tests.conftest import assert_greedy_equal

    lm = endless[name]
    engine = Engine.from_models(LoadedModel(lm=lm, tokenizer=None, path=name), config=EngineConfig(prefix_cache_mb=8))
    stop = StopConditions(max_new_tokens=16, eos_token_ids=lm.eos_token_ids or (lm.vocab_size - 1,))

    def generate(prompt):
        hits = engine.prefix_cache.stats.hits
        out = engine.generate_ids([prompt], method=method, stop=stop)[0].token_ids
        assert_greedy_equal(lm, prompt, out, plain_generate(lm, [prompt], stop=stop)[0].token_ids)
        return list(out), engine.prefix_cache.stats.hits - hits

    first, cold = generate(PROMPT)
    _, shared = generate(PROMPT[:40] + [5, 6, 7])
    turn2 = PROMPT + first + [8, 9, 10]
    _, turn = generate(turn2)
    # all it shares with the first call's prompt (found by blocks, reused to the token), on llama.cpp too
    # (every width rounds alike there: a decoded answer's KV is a fresh prefill's)
    assert cold == 0 and shared == 40
    assert turn >= 16 * ((len(PROMPT) + len(first) - 1) // 16), "the next turn did not reuse the first turn's answer"
    assert 0 < engine.prefix_cache.bytes_held <= 8 << 20


def test_llamacpp_reuses_a_decoded_answer_with_a_fresh_prefills_logits_bit_for_bit(backends):
    """Every width rounds alike on specdec's llama.cpp (WIDTH_INVARIANT_ENV): a next turn restores the
    first turn's prompt and decoded answer, and its logits are those of a fresh prefill, bit for bit."""
    from specdec.prefix_cache import remember, restore_longest

    lm, cache = backends["llamacpp"], PrefixCache(8 << 20)
    assert lm.prefill_block == 1
    kv = lm.new_cache(1)
    logits, answer = _continue(lm, kv, PROMPT, 12)  # turn 1: a prefill, then one token a forward
    assert remember(cache, lm, kv, PROMPT + answer[:-1], prefilled=len(PROMPT))
    turn2 = PROMPT + answer + [8, 9, 10]
    fresh, fresh_out = _continue(lm, lm.new_cache(1), turn2, 8)
    n, restored = restore_longest(cache, lm, turn2, at_most=len(turn2) - 1)
    assert n == len(PROMPT) + len(answer) - 1
    logits, out = _continue(lm, restored, turn2[n:], 8)
    assert torch.equal(logits, fresh) and out == fresh_out


def test_a_backend_of_width_dependent_kernels_reuses_only_whole_prefill_blocks_of_prompts(backends):
    """With a prefill block > 1 (a backend whose kernels change with a forward's token count), a next
    turn restores its prompt's whole prefill blocks, never the decoded answer nor a part block."""
    from specdec.prefix_cache import remember, restore_longest

    lm, cache, block = backends["llamacpp"], PrefixCache(8 << 20), LLAMACPP_BLOCK
    kv = lm.new_cache(1)
    _, answer = _continue(lm, kv, PROMPT, 12)
    assert remember(cache, lm, kv, PROMPT + answer[:-1], prefilled=len(PROMPT), block=block)
    turn2 = PROMPT + answer + [8, 9, 10]
    n, restored = restore_longest(cache, lm, turn2, at_most=len(turn2) - 1, block=block)
    assert n == block * (len(PROMPT) // block)
    shares = block + 3
    assert restore_longest(cache, lm, PROMPT[:shares] + [4], at_most=shares, block=block)[0] == block


def test_seeded_sampling_is_the_same_with_the_engines_prefix_cache_on_or_off(endless):
    from specdec.engine import Engine, EngineConfig
    from specdec.models import LoadedModel
    from specdec.types import SamplingParams, StopConditions

    lm = endless["fast"]
    on = Engine.from_models(LoadedModel(lm=lm, tokenizer=None, path="fast"), config=EngineConfig(prefix_cache_mb=8))
    off = Engine.from_models(LoadedModel(lm=lm, tokenizer=None, path="fast"), config=EngineConfig(prefix_cache_mb=0))
    sampling, stop = SamplingParams(temperature=0.9, seed=7), StopConditions(max_new_tokens=12)
    for engine in (on, off):
        engine.generate_ids([PROMPT], sampling=sampling, stop=stop)  # warms the cache of `on`
    got = [e.generate_ids([PROMPT[:40] + [3, 4]], method="prompt-lookup", sampling=sampling, stop=stop)[0].token_ids
           for e in (on, off)]
    assert on.prefix_cache.stats.hits >= 32 and off.prefix_cache is None
    assert got[0] == got[1]
