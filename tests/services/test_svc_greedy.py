"""Greedy output through the services (draft, target, coordinator, Redis) equals in-process
speculative_generate and plain decoding: with the draft service, with target-side methods,
and for many concurrent sessions."""

from __future__ import annotations

import asyncio
import copy

import pytest

from specdec.decode import plain_generate, speculative_generate
from specdec.proposers import PROPOSERS
from specdec.proposers import DraftModelProposer
from specdec.types import SamplingParams, StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import local_stack, mean_batch_size, run

PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 10, 11, 12, 13, 14], [20, 21, 22], [40, 41, 42, 43]]
TARGET_METHODS = ["plain", "target", "prompt-lookup"] + [m for m in ("lookahead",) if m in PROPOSERS]


def _plain(lm, prompt, n):
    return plain_generate(lm, [prompt], stop=StopConditions(max_new_tokens=n, eos_token_ids=lm.eos_token_ids))[0]


def test_draft_method_equals_in_process_speculative_and_plain(redis_url, tiny_target, tiny_draft):
    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft) as st:
            outs = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=40,
                                                                                method="draft")) for p in PROMPTS))
            for _ in range(50):  # finished sessions release their KV caches on both services
                if not st.targets[0].core.sessions and not st.drafts[0].core.sessions:
                    break
                await asyncio.sleep(0.1)
            return outs, len(st.targets[0].core.sessions) + len(st.drafts[0].core.sessions)

    outs, held = run(scenario())
    assert held == 0, "finished sessions kept their KV caches"
    stop = StopConditions(max_new_tokens=40, eos_token_ids=tiny_target.eos_token_ids)
    for p, out in zip(PROMPTS, outs):
        plain = _plain(tiny_target, p, 40)
        spec = speculative_generate(tiny_target, DraftModelProposer(tiny_draft), [p], stop=stop, k=4)[0]
        assert_greedy_equal(tiny_target, p, out.token_ids, plain.token_ids)
        assert_greedy_equal(tiny_target, p, out.token_ids, spec.token_ids)
        assert out.finish_reason == plain.finish_reason
    assert sum(o.stats["accepted"] for o in outs) > 0, "nothing accepted: the rollback paths did not run"
    assert all(o.stats["fallback_steps"] == 0 for o in outs)


@pytest.mark.parametrize("method", TARGET_METHODS)
def test_target_side_method_equals_plain(redis_url, long_target, method):
    async def scenario():
        async with local_stack(redis_url, long_target) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=20,
                                                                                method=method)) for p in PROMPTS[:3]))

    for p, out in zip(PROMPTS, run(scenario())):
        assert_greedy_equal(long_target, p, out.token_ids, _plain(long_target, p, 20).token_ids)
        assert out.stats["emitted"] == 20 and out.finish_reason == "length"


def test_auto_without_draft_replicas_falls_back_to_the_target(redis_url, long_target):
    async def scenario():
        async with local_stack(redis_url, long_target) as st:
            return await st.client.generate(st.client.request(token_ids=PROMPTS[1], max_tokens=20))

    out = run(scenario())
    assert_greedy_equal(long_target, PROMPTS[1], out.token_ids, _plain(long_target, PROMPTS[1], 20).token_ids)
    assert out.stats["fallback_steps"] > 0


def _on_backend(lm, backend):
    if backend == "hf":
        return lm
    from specdec.fast import FastLlamaLM

    return FastLlamaLM(copy.deepcopy(lm.model), name=lm.name)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_sixteen_concurrent_sessions_equal_their_solo_outputs(redis_url, long_target, weak_draft, backend):
    """Both services batch concurrent sessions by stacking their KV caches, on either backend."""
    prompts = [[(7 * i + j) % 90 + 2 for j in range(3 + i % 5)] for i in range(16)]
    target, draft = _on_backend(long_target, backend), _on_backend(weak_draft, backend)

    async def scenario():
        async with local_stack(redis_url, target, draft) as st:
            outs = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=24))
                                          for p in prompts))
            return outs, mean_batch_size(st.targets[0].metrics)

    outs, batched = run(scenario())
    for p, out in zip(prompts, outs):
        assert_greedy_equal(long_target, p, out.token_ids, _plain(long_target, p, 24).token_ids)
    assert all(o.stats["fallback_steps"] == 0 for o in outs), "the draft service failed"
    assert batched > 1.5, "concurrent Verify calls were not batched"


def test_pipelined_output_equals_plain_and_uses_drafted_ahead_blocks(redis_url, long_target, good_draft):
    from dataclasses import replace

    from tests.services.stack import FAST

    async def scenario():
        async with local_stack(redis_url, long_target, good_draft, settings=replace(FAST, pipeline=True)) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=40))
                                          for p in PROMPTS))

    outs = run(scenario())
    for p, out in zip(PROMPTS, outs):
        assert_greedy_equal(long_target, p, out.token_ids, _plain(long_target, p, 40).token_ids)
    assert sum(o.stats["pipeline_hits"] for o in outs) > 0
    assert sum(o.stats["pipeline_misses"] for o in outs) > 0


def test_seeded_sampling_through_the_services_is_reproducible(redis_url, long_target, weak_draft):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=1234)

    async def scenario():
        async with local_stack(redis_url, long_target, weak_draft) as st:
            a = await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=30, sampling=sampling))
            b = await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=30, sampling=sampling))
            return a, b

    a, b = run(scenario())
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert a.stats["drafted"] > 0
    assert a.token_ids != tuple(_plain(long_target, PROMPTS[0], 30).token_ids)
