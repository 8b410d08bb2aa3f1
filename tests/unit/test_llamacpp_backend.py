"""The llama.cpp backend on a tiny GGUF written by the test (the tiny torch target's weights in
float32): the same logits as the torch model, and every method's greedy output equal to this
backend's own plain greedy output, batched, with rollback, trees through sequence ids."""

import pytest
import torch

from specdec.decode import plain_generate, speculative_generate
from specdec.errors import InvalidRequest
from specdec.proposers import DraftModelProposer, PromptLookupProposer
from specdec.tree import block_mask, depths
from specdec.types import SamplingParams, StopConditions
from tests.conftest import assert_greedy_equal, full_logits, gguf_copy

PROMPTS = [[5, 17, 33, 2, 40], [9, 9], [60, 12, 7, 88, 3, 21, 45, 50, 11]]


@pytest.fixture(scope="module")
def gguf_target(tiny_target, tmp_path_factory):
    return gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_gguf_model_computes_the_torch_model_logits(gguf_target, tiny_target):
    ids = PROMPTS[2] + PROMPTS[0]
    torch.testing.assert_close(full_logits(gguf_target, ids), full_logits(tiny_target, ids), atol=2e-3, rtol=1e-3)


def test_plain_decoding_equals_the_torch_model(gguf_target, tiny_target):
    stop = StopConditions(max_new_tokens=24)
    for p in PROMPTS:
        got = plain_generate(gguf_target, [p], stop=stop)[0]
        want = plain_generate(tiny_target, [p], stop=stop)[0]
        assert_greedy_equal(tiny_target, p, got.token_ids, want.token_ids)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_speculative_equals_plain_on_llamacpp(gguf_target, tiny_draft, name, k, batch):
    stop = StopConditions(max_new_tokens=29)
    proposer = DraftModelProposer(tiny_draft) if name == "draft_model" else PromptLookupProposer()
    want = [plain_generate(gguf_target, [p], stop=stop)[0] for p in PROMPTS[:batch]]
    got = speculative_generate(gguf_target, proposer, PROMPTS[:batch], stop=stop, k=k)
    for p, g, w in zip(PROMPTS, got, want):
        assert_greedy_equal(gguf_target, p, g.token_ids, w.token_ids)
    if name == "draft_model":
        assert sum(g.stats.accepted for g in got) > 0 and sum(g.stats.drafted - g.stats.accepted for g in got) > 0


def test_rolling_back_a_block_continues_like_the_kept_prefix_alone(gguf_target):
    prompt = PROMPTS[0]
    cache = gguf_target.new_cache(1)
    gguf_target.prefill(cache, [prompt])
    gguf_target.forward(cache, torch.tensor([[3, 4, 5, 6]]))
    cache.keep_last(torch.tensor([[True, True, False, False]]))
    after = gguf_target.forward(cache, torch.tensor([[9]])).logits[0, -1]
    # llama.cpp's kernels round differently for 1-token and many-token batches; seeing a dropped
    # input would move the logits far more.
    torch.testing.assert_close(after, full_logits(gguf_target, prompt + [3, 4, 9])[-1], atol=3e-3, rtol=1e-3)
    assert (after - full_logits(gguf_target, prompt + [3, 4, 5, 9])[-1]).abs().max() > 3e-2


def test_rows_rolled_back_together_stay_apart(gguf_target):
    """One row's rollback leaves the other row's entries (and its next logits) as they were."""
    a, b = PROMPTS[2], PROMPTS[0]
    cache = gguf_target.new_cache(2)
    gguf_target.prefill(cache, [a, b])
    ids = torch.tensor([[5, 6, 7, 8], [21, 22, 0, 0]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    gguf_target.forward(cache, ids, input_valid=valid)
    cache.keep_last(torch.tensor([[True, False, False, False], [True, True, False, False]]))
    out = gguf_target.forward(cache, torch.tensor([[11, 12], [23, 24]])).logits
    torch.testing.assert_close(out[0, -1], full_logits(gguf_target, a + [5, 11, 12])[-1], atol=3e-3, rtol=1e-3)
    torch.testing.assert_close(out[1, -1], full_logits(gguf_target, b + [21, 22, 23, 24])[-1], atol=3e-3, rtol=1e-3)


def test_rows_that_finish_early_leave_the_others_exact(gguf_target, tiny_draft):
    free = [plain_generate(gguf_target, [p], stop=StopConditions(max_new_tokens=30))[0].token_ids for p in PROMPTS]
    stop = StopConditions(max_new_tokens=30, eos_token_ids=(free[1][4],))  # row 1 stops early
    want = [plain_generate(gguf_target, [p], stop=stop)[0] for p in PROMPTS]
    got = speculative_generate(gguf_target, DraftModelProposer(tiny_draft), PROMPTS, stop=stop, k=4)
    for p, g, w in zip(PROMPTS, got, want):
        assert_greedy_equal(gguf_target, p, g.token_ids, w.token_ids)
    assert len(got[1].token_ids) < len(got[0].token_ids)


def test_sampling_on_llamacpp_follows_the_seed(gguf_target):
    sampling = SamplingParams(temperature=0.8, seed=3)
    first = plain_generate(gguf_target, PROMPTS, sampling, StopConditions(max_new_tokens=12))
    again = plain_generate(gguf_target, PROMPTS, sampling, StopConditions(max_new_tokens=12))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_trees_and_non_causal_masks_are_refused_clearly(gguf_target):
    cache = gguf_target.new_cache(1)
    tree = block_mask((-1, -1))[None]  # root with two children
    with pytest.raises(InvalidRequest, match="not trees"):
        gguf_target.forward(cache, torch.tensor([[1, 2, 3]]), tree, depths((-1, -1))[None])
    skip_root = torch.tensor([[[1, 0, 0], [1, 1, 0], [0, 1, 1]]], dtype=torch.bool)
    with pytest.raises(InvalidRequest, match="causal blocks only"):
        gguf_target.forward(cache, torch.tensor([[1, 2, 3]]), skip_root)


def test_rows_of_unequal_lengths_get_the_logits_each_gets_alone(gguf_target):
    prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((100, 50, 90))]
    together = gguf_target.prefill(gguf_target.new_cache(3), prompts).logits
    for row, p in enumerate(prompts):
        alone = gguf_target.prefill(gguf_target.new_cache(1), [p]).logits[0]
        torch.testing.assert_close(together[row], alone, atol=1e-4, rtol=1e-4)  # seen before: off by up to 1.0


def test_a_finished_caches_context_is_cleared_and_reused(gguf_target):
    """Making a llama.cpp context costs ~40 ms: a dropped cache's context serves the next cache of
    its size, emptied (nothing of the last generation leaks into the next one's logits)."""
    import gc

    fresh = full_logits(gguf_target, PROMPTS[0])
    cache = gguf_target.new_cache(1)
    gguf_target.prefill(cache, [PROMPTS[2] * 3])  # fill it with something else
    del cache
    gc.collect()
    made = gguf_target.contexts.made
    again = gguf_target.new_cache(1)
    assert gguf_target.contexts.made == made  # not a new context
    assert int(again.lengths[0]) == 0
    gguf_target.prefill(again, [PROMPTS[2] * 3])
    del again
    gc.collect()
    torch.testing.assert_close(full_logits(gguf_target, PROMPTS[0]), fresh, atol=0, rtol=0)
    assert gguf_target.contexts.made == made


def test_a_greedy_step_is_a_forward_and_its_argmax(gguf_target):
    """greedy_step (the one-row greedy fast path of plain decoding and the target's Decode) feeds
    the same token as forward() and leaves the cache as forward() does: the tokens it picks and
    the logits of every later forward are forward's."""
    prompt = PROMPTS[2]
    fast, slow = gguf_target.new_cache(1), gguf_target.new_cache(1)
    token = int(gguf_target.prefill(fast, [prompt]).logits[0].argmax())
    assert int(gguf_target.prefill(slow, [prompt]).logits[0].argmax()) == token
    a = b = token
    for _ in range(12):
        a = gguf_target.greedy_step(fast, a)
        b = int(gguf_target.forward(slow, torch.tensor([[b]])).logits[0, -1].argmax())
        slow.settle()
        assert a == b and fast.lengths.tolist() == slow.lengths.tolist()
    torch.testing.assert_close(gguf_target.forward(fast, torch.tensor([[a]])).logits,
                               gguf_target.forward(slow, torch.tensor([[b]])).logits)
    with pytest.raises(ValueError, match="batch-1"):
        gguf_target.greedy_step(gguf_target.new_cache(2), a)


def test_after_a_burst_of_sessions_one_idle_context_stays(gguf_target):
    """Each context holds its whole KV buffer: while sessions run, finished ones leave theirs
    for the next (up to `keep`); once none runs, one stays (memory back to one idle session's)."""
    import gc

    from specdec.backends.llamacpp.model import LlamaCppLM

    lm = LlamaCppLM(gguf_target.path, threads=1)
    caches = [lm.new_cache(1) for _ in range(6)]
    for cache in caches:
        lm.prefill(cache, [PROMPTS[0]])
    assert lm.contexts.made == 6 and lm.contexts.in_use == 6
    del caches[1:], cache
    gc.collect()
    assert lm.contexts.in_use == 1 and lm.contexts.idle == lm.contexts.keep  # kept for the sessions to come
    made = lm.contexts.made
    again = lm.new_cache(1)
    assert lm.contexts.made == made and int(again.lengths[0]) == 0  # reused, empty
    del again, caches
    gc.collect()
    assert lm.contexts.in_use == 0 and lm.contexts.idle == 1
    torch.testing.assert_close(full_logits(lm, PROMPTS[0]), full_logits(gguf_target, PROMPTS[0]), atol=0, rtol=0)


def test_the_target_services_warm_up_leaves_a_context_for_the_first_session(gguf_target):
    """target_service.core.warm_up runs before the service serves: the first session's cache
    takes the context it made instead of making one (~40 ms on the real model)."""
    from specdec.backends.llamacpp.model import LlamaCppLM
    from target_service.core import warm_up

    fresh = LlamaCppLM(gguf_target.path, threads=1)  # (no idle context yet)
    warm_up(fresh)
    assert fresh.contexts.made == 1
    cache = fresh.new_cache(1)
    assert fresh.contexts.made == 1 and int(cache.lengths[0]) == 0  # the warm-up's, handed over empty
