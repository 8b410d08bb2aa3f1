"""Sampling through the services: drafts say whether they were sampled (and then carry their
probabilities), sampled drafts keep the target's distribution, and seeded outputs do not depend
on batch neighbours."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import scipy.stats
import torch

from draft_service.servicer import start_draft_server
from specdec.rpc import convert
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.rpc.v1 import target_pb2
from specdec.sampling import logits_to_probs
from specdec.types import DraftBlock, DraftKind, SamplingParams
from target_service.servicer import start_target_server
from tests.conftest import full_logits
from tests.services.stack import local_stack, mean_batch_size, run

SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=1234)
PROMPT = [5, 6, 7, 8, 9]


async def _raw_verify(client: TargetClient, session_id: str, draft_ids, sampling: SamplingParams, **fields):
    """A Verify as any client may send it -> (status code, details)."""
    req = target_pb2.VerifyRequest(position=convert.position_to_pb(session_id, PROMPT, len(PROMPT)),
                                   draft_token_ids=list(draft_ids), sampling=convert.sampling_to_pb(sampling),
                                   **fields)
    try:
        await client.stub.Verify(req, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_a_verify_under_sampling_must_say_its_draft_kind_and_a_sampled_draft_must_carry_its_probs(long_target):
    probs = convert.draft_probs_to_pb(torch.full((2, long_target.vocab_size), 1 / long_target.vocab_size))
    sampled, deterministic = target_pb2.DRAFT_KIND_SAMPLED, target_pb2.DRAFT_KIND_DETERMINISTIC

    async def scenario():
        server = await start_target_server(long_target)
        client = TargetClient(server.address)
        sid = "session-kind-0001"
        try:
            await client.prefill(sid, PROMPT)
            return {
                "unsaid": await _raw_verify(client, sid, [3, 4], SEEDED),
                "sampled without probs": await _raw_verify(client, sid, [3, 4], SEEDED, draft_kind=sampled),
                "deterministic with probs": await _raw_verify(client, sid, [3, 4], SEEDED, draft_kind=deterministic,
                                                              draft_probs=probs),
                "sampled with probs": await _raw_verify(client, sid, [3, 4], SEEDED, draft_kind=sampled,
                                                        draft_probs=probs),
                "deterministic": await _raw_verify(client, sid, [3, 4], SEEDED, draft_kind=deterministic),
                "greedy unsaid": await _raw_verify(client, sid, [3, 4], SamplingParams()),
                "plain step unsaid": await _raw_verify(client, sid, [], SEEDED),
            }
        finally:
            await client.close()
            await server.stop(0)

    got = run(scenario())
    IA, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK
    assert {name: code for name, (code, _) in got.items()} == {
        "unsaid": IA, "sampled without probs": IA, "deterministic with probs": IA, "sampled with probs": OK,
        "deterministic": OK, "greedy unsaid": OK, "plain step unsaid": OK}
    assert "draft_kind is required when sampling" in got["unsaid"][1]
    assert "SAMPLED draft needs its draft_probs" in got["sampled without probs"][1]
    assert "DETERMINISTIC draft carries no draft_probs" in got["deterministic with probs"][1]


def _first_token_counts(target_lm, draft_lm, sampling: SamplingParams, n: int, k: int, sampled: bool):
    """n Verify calls at the same position, seeds 0..n-1: counts [vocab] of the first emitted token.
    sampled: the draft service drafts (SAMPLED, with draft_probs); else a fixed DETERMINISTIC draft."""
    async def scenario():
        target = await start_target_server(target_lm)
        draft = await start_draft_server(draft_lm)
        tc, dc = TargetClient(target.address), DraftClient(draft.address)
        sid = "session-chi-square"
        counts = torch.zeros(target_lm.vocab_size, dtype=torch.long)
        try:
            await tc.prefill(sid, PROMPT)
            await dc.prefill(sid, PROMPT)
            fixed = DraftBlock(tuple(range(3, 3 + k)), None, None, DraftKind.DETERMINISTIC)
            for seed in range(n):
                params = replace(sampling, seed=seed)
                block = await dc.propose(sid, PROMPT, len(PROMPT), k, params) if sampled else fixed
                res = await tc.verify(sid, PROMPT, len(PROMPT), block.token_ids, block.draft_probs, params, block.kind)
                counts[res.emitted[0]] += 1
            return counts, block
        finally:
            await tc.close()
            await dc.close()
            await draft.stop(0)
            await target.stop(0)

    return run(scenario(), timeout=300)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts [vocab] against probs [vocab] over the support of
    probs; 0 when a token outside that support was counted."""
    support = probs > 0
    if int(counts[~support].sum()):
        return 0.0
    expected = probs[support].double() / probs[support].double().sum() * int(counts.sum())
    return float(scipy.stats.chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-draft", "deterministic-draft"])
def test_first_emitted_token_through_the_services_is_distributed_as_the_target(long_target, weak_draft, sampled):
    sampling = SamplingParams(temperature=1.5, top_k=8)
    counts, block = _first_token_counts(long_target, weak_draft, sampling, n=1200, k=3, sampled=sampled)
    target_probs = logits_to_probs(full_logits(long_target, PROMPT)[-1], sampling)  # [vocab]
    assert (block.draft_probs is not None) == sampled
    assert 1200 * float(target_probs[target_probs > 0].min()) >= 5, "too few samples for a chi-square test"
    assert _chi_square_p(counts, target_probs) > 1e-3
    # The same counts tell a different distribution apart (the draft's own): the test has power.
    draft_probs = logits_to_probs(full_logits(weak_draft, PROMPT)[-1], sampling)  # [vocab]
    assert _chi_square_p(counts, draft_probs) < 1e-6


def test_a_seeded_request_gives_the_same_text_alone_and_among_seven_concurrent_sessions(redis_url, long_target,
                                                                                      weak_draft):
    prompt = PROMPT
    # Same sampling settings (so the draft service drafts them in one batch group), other prompts
    # of other lengths (so their positions differ from ours).
    others = [[10 + i] * (2 + i) for i in range(7)]

    async def scenario():
        async with local_stack(redis_url, long_target, weak_draft) as st:
            def request(p):
                return st.client.request(token_ids=p, max_tokens=30, sampling=SEEDED, k=4, method="draft")

            alone = await st.client.generate(request(prompt))
            *_, among = await asyncio.gather(*(st.client.generate(request(p)) for p in [*others, prompt]))
            return alone, among, mean_batch_size(st.drafts[0].core.metrics)

    alone, among, batched = run(scenario())
    assert batched > 1.5, "the draft service never batched the sessions"
    assert alone.stats["drafted"] > 0 and len(alone.token_ids) == 30
    assert among.token_ids == alone.token_ids
