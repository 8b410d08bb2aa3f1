"""Bad input gets the right status code and a one-line message, and the services stay up."""

from __future__ import annotations

import grpc

from specdec.rpc import convert
from specdec.rpc.clients import CoordinatorClient
from specdec.rpc.serving import ServerSettings, start_server
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from specdec.types import SamplingParams
from tests.conftest import assert_greedy_equal
from tests.services.stack import local_stack, run, status_of

OK_PROMPT = [5, 6, 7, 8]


COORDINATOR_CASES = {
    "empty token prompt": (dict(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "empty text prompt": (dict(text="   "), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "negative max tokens": (dict(token_ids=OK_PROMPT, max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "huge max tokens": (dict(token_ids=OK_PROMPT, max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    "k too large": (dict(token_ids=OK_PROMPT, k=1000), grpc.StatusCode.INVALID_ARGUMENT, "k must be"),
    "negative k": (dict(token_ids=OK_PROMPT, k=-1), grpc.StatusCode.INVALID_ARGUMENT, "k must be"),
    "out of vocabulary ids": (dict(token_ids=[5, 96]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "negative token id": (dict(token_ids=[5, -3]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "oversize request": (dict(text="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    "malformed session id": (dict(token_ids=OK_PROMPT, session_id="../../etc/passwd"),
                             grpc.StatusCode.INVALID_ARGUMENT, "session id"),
    "unknown session": (dict(session_id="no-such-session-123"), grpc.StatusCode.NOT_FOUND, "unknown session"),
    "resume beyond the end": (dict(session_id="no-such-session-456", resume_from=3), grpc.StatusCode.NOT_FOUND, ""),
    "unknown method": (dict(token_ids=OK_PROMPT, method="telepathy"), grpc.StatusCode.INVALID_ARGUMENT, "method"),
    "negative temperature": (dict(token_ids=OK_PROMPT, sampling=SamplingParams.__new__(SamplingParams)),
                             grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "text without a tokenizer": (dict(text="hello"), grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
}
object.__setattr__(COORDINATOR_CASES["negative temperature"][0]["sampling"], "temperature", -1.0)
for _f, _v in (("top_k", 0), ("top_p", 1.0), ("seed", None)):
    object.__setattr__(COORDINATOR_CASES["negative temperature"][0]["sampling"], _f, _v)


def test_coordinator_rejects_bad_requests_with_the_right_status_and_stays_up(redis_url, tiny_target, tiny_draft):
    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft) as st:
            got = {}
            for name, (kwargs, _, _) in COORDINATOR_CASES.items():
                got[name] = await status_of(st.client.generate(CoordinatorClient.request(**kwargs), timeout=30))
            ok = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=5))
            return got, ok

    got, ok = run(scenario())
    for name, (_, code, words) in COORDINATOR_CASES.items():
        assert got[name][0] == code, f"{name}: {got[name]}"
        assert words in got[name][1], f"{name}: {got[name][1]!r} lacks {words!r}"
        assert "Traceback" not in got[name][1] and "Error(" not in got[name][1]
    assert len(ok.token_ids) >= 1


def test_draft_and_target_reject_bad_calls_and_unknown_sessions(redis_url, tiny_target, tiny_draft):
    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft) as st:
            sid = "session-bad-input"
            d, t, pos = await st.raw_session(sid, OK_PROMPT)
            calls = {
                "unknown session verify": t.Verify(target_pb2.VerifyRequest(  # (it would hold the first 2 tokens)
                    position=convert.position_to_pb("session-unknown", OK_PROMPT, 2)), timeout=10),
                "stale digest": t.Verify(target_pb2.VerifyRequest(position=common_pb2.SessionPosition(
                    session_id=sid, committed_len=4, committed_digest=12345)), timeout=10),
                "draft token out of vocab": t.Verify(target_pb2.VerifyRequest(position=pos, draft_token_ids=[500]),
                                                     timeout=10),
                "too many draft tokens": t.Verify(target_pb2.VerifyRequest(position=pos, draft_token_ids=[3] * 100),
                                                  timeout=10),
                "unknown decode method": t.Decode(target_pb2.DecodeRequest(position=pos, max_tokens=3,
                                                                           method="nope"), timeout=10),
                "propose k zero": d.Propose(draft_pb2.ProposeRequest(position=pos, k=0), timeout=10),
                "propose unknown session": d.Propose(draft_pb2.ProposeRequest(
                    position=convert.position_to_pb("session-unknown", OK_PROMPT, 0), k=2), timeout=10),
                "bad session id": d.Prefill(common_pb2.PrefillRequest(session_id="x y", token_ids=[1]), timeout=10),
            }
            got = {}
            for name, call in calls.items():
                try:
                    await call
                    got[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    got[name] = exc.code()
            ok = await t.Verify(target_pb2.VerifyRequest(position=pos, draft_token_ids=[3]), timeout=10)
            # A position that names every committed token starts a session the target does not hold
            # (the coordinator's first step then needs no Prefill): the same verdict as after a Prefill.
            fresh = await t.Verify(target_pb2.VerifyRequest(
                position=convert.position_to_pb("session-fresh", OK_PROMPT, 0), draft_token_ids=[3]), timeout=10)
            return got, ok, fresh

    got, ok, fresh = run(scenario())
    NF, IA = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT
    assert got == {"unknown session verify": NF, "stale digest": NF, "draft token out of vocab": IA,
                   "too many draft tokens": IA, "unknown decode method": IA, "propose k zero": IA,
                   "propose unknown session": NF, "bad session id": IA}
    assert len(ok.emitted_token_ids) >= 1
    assert (fresh.num_accepted, list(fresh.emitted_token_ids)) == (ok.num_accepted, list(ok.emitted_token_ids))


class _Exploding(draft_pb2_grpc.DraftServiceServicer):
    async def Info(self, request, context):
        raise RuntimeError("secret internal detail /etc/shadow")


def test_unexpected_errors_reach_clients_as_internal_without_details():
    async def scenario():
        running = await start_server(ServerSettings(), lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(
            _Exploding(), s), ["specdec.rpc.v1.DraftService"], ServiceMetrics("test"))
        try:
            async with grpc.aio.insecure_channel(running.address) as ch:
                try:
                    await draft_pb2_grpc.DraftServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
        finally:
            await running.stop(0)

    code, details = run(scenario())
    assert code == grpc.StatusCode.INTERNAL
    assert details == "internal error"


def test_an_overloaded_target_answers_resource_exhausted(redis_url, long_target):
    from target_service.core import TargetSettings

    async def scenario():
        async with local_stack(redis_url, long_target, target_settings=TargetSettings(max_queue=0)) as st:
            return await status_of(st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=4, method="plain")))

    code, message = run(scenario())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in message


def test_a_draft_with_another_vocabulary_is_refused_and_the_target_decodes_alone(redis_url, long_target):
    from specdec.decode import plain_generate
    from specdec.testing import tiny_llama
    from specdec.types import StopConditions

    other_vocab = tiny_llama(seed=5, vocab_size=80, num_layers=1, hidden_size=32)

    async def scenario():
        async with local_stack(redis_url, long_target, other_vocab) as st:
            out = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=12))
            return out, st.drafts[0].core.sessions, st.core.draft_pool.live()

    out, draft_sessions, live = run(scenario())
    want = plain_generate(long_target, [OK_PROMPT], stop=StopConditions(max_new_tokens=12))[0].token_ids
    assert_greedy_equal(long_target, OK_PROMPT, out.token_ids, want)
    assert out.stats["fallback_steps"] > 0 and not draft_sessions and not live
