"""Greedy output through the services (draft, target, coordinator, Redis) equals in-process
speculative_generate and plain decoding: with the draft service, with target-side methods,
and for many concurrent sessions."""

from __future__ import annotations

import asyncio
import copy

import pytest

from specdec.decode import speculative_generate
from specdec.proposers import PROPOSERS
from specdec.proposers import DraftModelProposer
from specdec.types import SamplingParams, StopConditions
from target_service.core import TargetSettings
from tests.conftest import GPU_LIKE_COST, LLAMACPP_CPU_COST, FixedCosts, assert_greedy_equal, plain
from tests.services.stack import handled, local_stack, mean_batch_size, run

PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 10, 11, 12, 13, 14], [20, 21, 22], [40, 41, 42, 43]]
TARGET_METHODS = ["plain", "target", "prompt-lookup"] + [m for m in ("lookahead",) if m in PROPOSERS]


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
        want = plain(tiny_target, p, 40)
        spec = speculative_generate(tiny_target, DraftModelProposer(tiny_draft), [p], stop=stop, k=4)[0]
        assert_greedy_equal(tiny_target, p, out.token_ids, want.token_ids)
        assert_greedy_equal(tiny_target, p, out.token_ids, spec.token_ids)
        assert out.finish_reason == want.finish_reason
    assert sum(o.stats["accepted"] for o in outs) > 0, "nothing accepted: the rollback paths did not run"
    assert all(o.stats["fallback_steps"] == 0 for o in outs)


@pytest.mark.parametrize("method", TARGET_METHODS)
def test_target_side_method_equals_plain(redis_url, long_target, method):
    async def scenario():
        async with local_stack(redis_url, long_target) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=20,
                                                                                method=method)) for p in PROMPTS[:3]))

    for p, out in zip(PROMPTS, run(scenario())):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 20).token_ids)
        assert out.stats["emitted"] == 20 and out.finish_reason == "length"


def test_auto_without_draft_replicas_falls_back_to_the_target(redis_url, long_target):
    async def scenario():
        async with local_stack(redis_url, long_target) as st:
            return await st.client.generate(st.client.request(token_ids=PROMPTS[1], max_tokens=20))

    out = run(scenario())
    assert_greedy_equal(long_target, PROMPTS[1], out.token_ids, plain(long_target, PROMPTS[1], 20).token_ids)
    assert out.stats["fallback_steps"] > 0


def _on_backend(lm, backend):
    if backend == "hf":
        return lm
    from specdec.backends.fast import FastLlamaLM

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
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 24).token_ids)
    assert all(o.stats["fallback_steps"] == 0 for o in outs), "the draft service failed"
    assert batched > 1.5, "concurrent Verify calls were not batched"


def test_pipelined_output_equals_plain_and_uses_drafted_ahead_blocks(redis_url, long_target, good_draft):
    from dataclasses import replace

    from tests.services.stack import FAST

    async def scenario():
        async with local_stack(redis_url, long_target, good_draft, settings=replace(FAST, pipeline=True)) as st:
            return await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=40,
                                                                                method="draft"))
                                          for p in PROMPTS))

    outs = run(scenario())
    for p, out in zip(PROMPTS, outs):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 40).token_ids)
    assert sum(o.stats["pipeline_hits"] for o in outs) > 0
    assert sum(o.stats["pipeline_misses"] for o in outs) > 0


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_seeded_sampling_through_the_services_is_reproducible(redis_url, long_target, weak_draft, method):
    """Under auto too: the way a step is taken decides which random draws a seeded session makes,
    so a seeded request is not moved between ways by measurements (step_choice)."""
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=1234)

    async def scenario():
        async with local_stack(redis_url, long_target, weak_draft) as st:
            return [await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=30, sampling=sampling,
                                                               method=method)) for _ in range(3)]

    a, b, c = run(scenario())
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 30
    assert a.stats["drafted"] > 0 or method == "auto"
    assert a.token_ids != tuple(plain(long_target, PROMPTS[0], 30).token_ids)


NO_HISTORY = TargetSettings(history_tokens=0)


@pytest.mark.parametrize("slow_way", ["draft", "target"])
def test_auto_takes_the_way_that_costs_less_per_token_and_equals_plain(redis_url, long_target, good_draft, slow_way):
    """auto measures drafting and the target alone end to end and keeps to the cheaper one; the
    output is plain decoding's either way."""
    from tests.services.stack import slow

    target, draft = (slow(long_target, 30), good_draft) if slow_way == "target" else (long_target, slow(good_draft, 30))
    prompts = [p for p in PROMPTS for _ in range(2)]

    async def scenario():
        # The target alone decodes plainly (no prompt lookup on it): what it costs then depends on the
        # delay alone, not on how well lookup happens to do on the tiny model's repetitive output.
        # (a flat verify cost, as a GPU's: a draft could pay, so auto measures both ways)
        # No history drafts: each prompt comes twice, and the second would draft the first's answer.
        async with local_stack(redis_url, target, draft, methods={}, target_costs=FixedCosts(GPU_LIKE_COST),
                               target_settings=NO_HISTORY) as st:
            outs, proposes = [], []
            for p in prompts:  # one after another: each sees what the earlier ones measured
                outs.append(await st.client.generate(st.client.request(token_ids=p, max_tokens=48, method="auto")))
                proposes.append(_propose_calls(st.core.metrics))
            return outs, dict(st.core.step_rates.seconds_per_token), proposes

    outs, rates, proposes = run(scenario(), timeout=300)
    for p, out in zip(prompts, outs):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 48).token_ids)
    assert set(rates) == {"local", "draft"}, "auto did not measure both ways"
    later = proposes[-1] - proposes[1]  # draft-service steps after the first two sessions measured both ways
    if slow_way == "draft":
        assert rates["draft"] > rates["local"] and later <= 3, "auto kept drafting on a slow draft"
    else:  # each target forward costs 30 ms: verifying 4 drafted tokens at once beats 1 token per forward
        assert rates["draft"] < rates["local"] and later >= 20, "auto did not keep to the faster draft"


def test_auto_never_tries_the_draft_where_the_target_says_none_could_pay(redis_url, long_target, good_draft):
    """On a target whose verify cost makes any draft a loss (llama.cpp on a CPU), auto decodes on
    the target alone from the first step, never even measuring the draft; asked for by name, the
    draft still runs; both outputs are plain decoding's."""
    prompts = [p for p in PROMPTS for _ in range(2)]

    async def scenario():
        async with local_stack(redis_url, long_target, good_draft, methods={}, target_costs=FixedCosts(LLAMACPP_CPU_COST),
                               target_settings=NO_HISTORY) as st:  # (each prompt twice: no history drafts)
            auto = [await st.client.generate(st.client.request(token_ids=p, max_tokens=24, method="auto"))
                    for p in prompts]
            auto_proposes, rates = _propose_calls(st.core.metrics), dict(st.core.step_rates.seconds_per_token)
            named = await st.client.generate(st.client.request(token_ids=prompts[0], max_tokens=24, method="draft"))
            return auto, auto_proposes, named, rates

    auto, auto_proposes, named, rates = run(scenario())
    for p, out in zip(prompts, auto):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 24).token_ids)
        assert out.stats["drafted"] == 0 and out.stats["fallback_steps"] == 0
    assert auto_proposes == 0 and "draft" not in rates
    assert named.stats["drafted"] > 0
    assert_greedy_equal(long_target, prompts[0], named.token_ids, plain(long_target, prompts[0], 24).token_ids)


# A verify cost like llama.cpp's at 2 threads on the 2-core hosts measured (v(5) = 3.19): a
# perfect free draft would pay, one right a fifth of the time could not.
PAYS_ONLY_IF_RIGHT = {1: 1.0, 2: 1.44, 3: 1.9, 5: 3.19, 9: 6.0}


def test_auto_leaves_a_draft_idle_once_its_measured_acceptance_could_not_pay(redis_url, long_target, tmp_path):
    """auto measures a draft that is hardly ever right once; from then on its acceptance (kept in
    the coordinator's cost store) says it could not pay on this target even if it cost nothing,
    so no later session drafts, and a restarted coordinator with the same store never drafts at
    all. Outputs are plain decoding's throughout."""
    from specdec.costmodel import CostStore
    from specdec.step_choice import ACCEPTANCE_KEY
    from specdec.testing import tiny_llama

    stranger = tiny_llama(seed=7, vocab_size=96, num_layers=2, hidden_size=48, eos_token_id=None)  # unrelated weights
    prompts = [p for p in PROMPTS for _ in range(2)]

    async def sessions(costs):
        async with local_stack(redis_url, long_target, stranger, methods={}, target_costs=FixedCosts(PAYS_ONLY_IF_RIGHT),
                               coordinator_costs=costs) as st:
            outs, proposes = [], []
            for p in prompts:
                outs.append(await st.client.generate(st.client.request(token_ids=p, max_tokens=24, method="auto")))
                proposes.append(_propose_calls(st.core.metrics))
            return outs, proposes

    first_outs, first = run(sessions(CostStore(tmp_path)))
    counts = CostStore(tmp_path).acceptance_counts(long_target.name, ACCEPTANCE_KEY, stranger.name)
    again_outs, again = run(sessions(CostStore(tmp_path)))
    for p, out in zip(prompts * 2, first_outs + again_outs):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 24).token_ids)
    assert first[-1] > 0, "auto never measured the draft"
    assert counts is not None and counts[1] / counts[0] < 0.3, f"the draft's acceptance was not kept: {counts}"
    measured_in = next(i for i, n in enumerate(first) if n > 0)
    assert first[-1] == first[measured_in], "auto drafted again after the draft's acceptance ruled it out"
    assert again[-1] == 0, "a coordinator that knew the draft's acceptance still tried it"


@pytest.mark.parametrize("costs", ["gpu-like", "cpu-like"])
def test_a_draft_step_without_k_drafts_as_many_tokens_as_the_cost_model_predicts_best(redis_url, long_target,
                                                                                     good_draft, costs):
    """method "draft" with no k: default_k at first, then the k the cost model picks from the
    draft's measured acceptance and c and the target's verify cost: long blocks where a forward
    over many tokens costs about one (a GPU), single tokens where each costs about a step more
    (llama.cpp on these CPUs). A client's k is kept as given. Outputs are plain's throughout."""
    from tests.services.stack import slow

    curve = GPU_LIKE_COST if costs == "gpu-like" else PAYS_ONLY_IF_RIGHT
    prompts = [p for p in PROMPTS for _ in range(2)]

    async def scenario():
        # a target forward 20 ms slower than the draft's: c small, as a big target's against its draft
        async with local_stack(redis_url, slow(long_target, 20), good_draft, methods={},
                               target_costs=FixedCosts(curve)) as st:
            outs = [await st.client.generate(st.client.request(token_ids=p, max_tokens=40, method="draft"))
                    for p in prompts]
            given = await st.client.generate(st.client.request(token_ids=prompts[0], max_tokens=40, method="draft", k=3))
            return outs, given

    outs, given = run(scenario(), timeout=300)
    for p, out in zip(prompts, outs):
        assert_greedy_equal(long_target, p, out.token_ids, plain(long_target, p, 40).token_ids)
    per_step = [o.stats["drafted"] / o.stats["target_forwards"] for o in outs]
    assert per_step[0] == pytest.approx(4, abs=0.5), "the first session did not draft default_k"
    later = sum(o.stats["drafted"] for o in outs[-3:]) / sum(o.stats["target_forwards"] for o in outs[-3:])
    if costs == "gpu-like":  # a draft right ~90% of the time, forwards almost free: long blocks
        assert later > 5, per_step
    else:  # each drafted token costs the target about a step more: one at a time
        assert later < 2.5, per_step
    assert given.stats["drafted"] / given.stats["target_forwards"] <= 3


def _propose_calls(metrics) -> int:
    """Steps drafted on the draft service so far (the coordinator's propose timings)."""
    return int(next((s.value for s in metrics.step_phase.collect()[0].samples
                     if s.name.endswith("_count") and s.labels.get("phase") == "propose"), 0))


def test_an_answer_no_one_streams_takes_whole_chunks_and_equals_the_streamed_one(redis_url, long_target):
    """A unary request's tokens are seen only at the end: the target decodes it in chunks of
    unary_chunk from the start, where a streamed one ramps up (1, 2, 4, ...) so its first token
    comes at once. The tokens are the same."""
    async def scenario():
        async with local_stack(redis_url, long_target, methods={}) as st:
            metrics = st.targets[0].metrics
            unary = await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=40, method="target"))
            after_unary = handled(metrics, "Decode")
            streamed = [c async for c in st.client.generate_stream(
                st.client.request(token_ids=PROMPTS[0], max_tokens=40, method="target"))]
            return unary, after_unary, handled(metrics, "Decode") - after_unary, streamed

    unary, unary_calls, stream_calls, chunks = run(scenario())
    assert_greedy_equal(long_target, PROMPTS[0], unary.token_ids, plain(long_target, PROMPTS[0], 40).token_ids)
    assert tuple(t for c in chunks for t in c.token_ids) == unary.token_ids
    assert unary_calls == 1 and stream_calls >= 4
    assert len([c for c in chunks if c.token_ids]) >= 4  # the streamed one arrived in pieces
