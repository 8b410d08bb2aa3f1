"""History drafts on the target service: a plain Decode drafts what earlier (released) sessions
said after the same tokens, and its output stays plain decoding's."""

from __future__ import annotations

import pytest

from specdec.sessions import token_digest
from specdec.service.sync import Position
from specdec.types import DecodeResult, SamplingParams
from target_service.core import TargetCore, TargetSettings
from tests.conftest import GPU_LIKE_COST, LLAMACPP_CPU_COST, FixedCosts, assert_greedy_equal, gguf_copy, plain
from tests.services.stack import run

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # longer than the history's least match
N = 40


async def _answer(core: TargetCore, session_id: str, prompt: list[int], sampling=SamplingParams(),
                  chunks=(N,)) -> list[DecodeResult]:
    """Decode a session in the coordinator's chunks, then release it (its tokens join the history)."""
    tokens, out = list(prompt), []
    for n in chunks:
        pos = Position(len(tokens), () if out else tuple(prompt), token_digest(tokens))  # the first call starts it
        res = await core.decode(session_id, pos, n, "plain", sampling)
        tokens += res.emitted
        out.append(res)
    await core.release(session_id)
    return out


def _same_prompt_twice(target, costs, settings=TargetSettings(prefix_cache_mb=0), sampling=SamplingParams(),
                       chunks=(N,)):
    async def scenario():
        core = TargetCore(target, settings, methods={}, costs=costs)
        try:
            first = await _answer(core, "first-0001", PROMPT, sampling, chunks)
            second = await _answer(core, "again-0002", PROMPT, sampling, chunks)
            kept = core.metrics.history_tokens._value.get()
            assert kept == (0 if core.history is None else core.history.tokens)
            return first, second
        finally:
            await core.close()
    return run(scenario())


@pytest.fixture(scope="module")
def gguf_long_target(long_target, tmp_path_factory):
    return gguf_copy(long_target, tmp_path_factory.mktemp("gguf") / "long.gguf", context=512)


def _tokens(results: list[DecodeResult]) -> list[int]:
    return [t for r in results for t in r.emitted]


@pytest.mark.parametrize("chunks", [(N,), (1, 2, 4, 8, 16, 9)])  # one unary Decode, or a stream's growing chunks
def test_a_prompt_that_comes_again_drafts_its_earlier_answer_and_equals_plain(long_target, chunks):
    first, second = _same_prompt_twice(long_target, FixedCosts(GPU_LIKE_COST), chunks=chunks)
    want = plain(long_target, PROMPT, N).token_ids
    assert _tokens(first) == list(want)
    assert _tokens(second) == list(want)
    assert sum(r.num_drafted for r in first) == 0  # nothing kept yet
    drafted, accepted = sum(r.num_drafted for r in second), sum(r.num_accepted for r in second)
    assert accepted == drafted > 0  # the same answer: every drafted token right
    assert sum(r.target_forwards for r in second) < sum(r.target_forwards for r in first) / 2


def test_where_a_forward_over_k_tokens_costs_k_steps_history_drafts_stay_rare(long_target):
    """On a compute-bound target (v(k) ~ k) a draft gains little: the cost model keeps k small."""
    first, second = _same_prompt_twice(long_target, FixedCosts(LLAMACPP_CPU_COST))
    assert _tokens(second) == _tokens(first) == list(plain(long_target, PROMPT, N).token_ids)
    assert sum(r.num_drafted for r in second) <= N // 2


def test_off_or_seeded_sampling_drafts_nothing(long_target):
    _, second = _same_prompt_twice(long_target, FixedCosts(GPU_LIKE_COST),
                                   settings=TargetSettings(prefix_cache_mb=0, history_tokens=0))
    assert sum(r.num_drafted for r in second) == 0
    seeded = SamplingParams(temperature=0.8, seed=7)
    first, second = _same_prompt_twice(long_target, FixedCosts(GPU_LIKE_COST), sampling=seeded)
    assert sum(r.num_drafted for r in second) == 0
    assert _tokens(second) == _tokens(first)  # the seed alone decides a seeded session's tokens


def test_unseeded_sampling_drafts_from_the_history(long_target):
    sampled = SamplingParams(temperature=0.01)  # near-greedy: the earlier answer is still a good draft
    first, second = _same_prompt_twice(long_target, FixedCosts(GPU_LIKE_COST), sampling=sampled)
    assert sum(r.num_drafted for r in second) > 0 and sum(r.num_accepted for r in second) > 0


def test_on_llamacpp_the_history_drafts_and_output_equals_its_plain_decoding(gguf_long_target):
    first, second = _same_prompt_twice(gguf_long_target, FixedCosts(GPU_LIKE_COST), chunks=(1, 2, 4, 8, 16, 9))
    want = plain(gguf_long_target, PROMPT, N).token_ids
    assert_greedy_equal(gguf_long_target, PROMPT, _tokens(first), want)
    assert_greedy_equal(gguf_long_target, PROMPT, _tokens(second), want)
    assert sum(r.num_accepted for r in second) > 0


def test_beside_prompt_lookup_the_history_drafts_where_it_matches(long_target):
    """Where auto runs prompt lookup on the target (a forward over a few tokens costs about one),
    a prompt that comes again still drafts its earlier answer; the output stays plain's."""
    from specdec.proposers.prompt_lookup import PromptLookupProposer

    async def scenario():
        core = TargetCore(long_target, TargetSettings(prefix_cache_mb=0), methods={"prompt-lookup": PromptLookupProposer},
                          costs=FixedCosts(GPU_LIKE_COST))
        try:
            out = []
            for sid in ("first-0001", "again-0002"):
                pos = Position(len(PROMPT), tuple(PROMPT), token_digest(PROMPT))
                out.append(await core.decode(sid, pos, N, "prompt-lookup", SamplingParams(), k=2))
                await core.release(sid)
            return out
        finally:
            await core.close()

    first, again = run(scenario())
    want = list(plain(long_target, PROMPT, N).token_ids)
    assert list(first.emitted) == list(again.emitted) == want
    assert first.num_drafted <= first.target_forwards * 2  # prompt lookup's own: at most its k a step
    assert again.num_accepted == again.num_drafted and again.num_drafted > again.target_forwards * 2
