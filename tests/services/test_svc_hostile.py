"""Hostile requests over the authenticated path (issue 16, test 7): a client holding a good bearer
token sends oversize messages, out-of-vocabulary ids, hostile session ids and negative or huge
limits through raw gRPC. Each is refused with the right status and a message of ours, touches no
Redis key, and afterwards the coordinator still answers health SERVING and a normal request
returns text equal to plain decoding. Real gRPC servers, a real redis-server, a tiny model with a
character tokenizer."""

from __future__ import annotations

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from coordinator.servicer import PUBLIC_MAX_MESSAGE_BYTES, SERVICE_NAME
from specdec.decode import plain_generate
from specdec.rpc.security import token_hash
from specdec.rpc.serving import ServerSettings
from specdec.rpc.v1 import common_pb2, coordinator_pb2
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import TEXT_VOCAB, char_text_target, local_stack, run

GOOD = "hostile-test-good-token-0123456789"
PROMPT = [40, 41, 42, 43]
MAX_POSITIONS = 256
INT32_MAX = 2**31 - 1
IA, RE, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND
SESSION_WORDS = "malformed session id"


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    """A tiny target (no EOS: runs to max_tokens) with a character tokenizer the coordinator fetches."""
    return char_text_target(tmp_path_factory, max_positions=MAX_POSITIONS)


def _req(token_ids=PROMPT, **kw) -> coordinator_pb2.GenerateRequest:
    """A raw request: nothing on the client side checks or clamps any field."""
    req = coordinator_pb2.GenerateRequest(**kw)
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


# name -> (request, expected status, words the message must contain)
CASES = {
    # oversize messages: over the public 4 MiB limit, as text and as token ids
    "oversize text": (_req(None, text="x" * (5 << 20)), RE, "larger than max"),
    "oversize token ids": (_req([7] * (5 << 20)), RE, "larger than max"),
    # under the wire limit but far over the model's context
    "a million token ids": (_req([7] * 1_000_000), IA, "context"),
    # out-of-vocabulary ids
    "id = vocab size": (_req([5, TEXT_VOCAB]), IA, "vocabulary"),
    "id int32 max": (_req([5, INT32_MAX]), IA, "vocabulary"),
    "negative id": (_req([-1, 5]), IA, "vocabulary"),
    "id int32 min": (_req([-(2**31)]), IA, "vocabulary"),
    # hostile session ids
    "session id very long": (_req(session_id="a" * 100_000), IA, SESSION_WORDS),
    "session id 65 chars": (_req(session_id="b" * 65), IA, SESSION_WORDS),
    "session id path": (_req(session_id="../../etc/passwd"), IA, SESSION_WORDS),
    "session id redis glob": (_req(session_id="specdec:session:*"), IA, SESSION_WORDS),
    "session id with newline": (_req(session_id="abcdefgh\r\nFLUSHALL"), IA, SESSION_WORDS),
    "session id non-ASCII": (_req(session_id="séance-ünïcødé-セッション"), IA, SESSION_WORDS),
    "session id NUL": (_req(session_id="abcdefgh\x00ijkl"), IA, SESSION_WORDS),
    "session id too short": (_req(session_id="abc"), IA, SESSION_WORDS),
    "empty session id, no prompt": (_req(None, session_id=""), IA, "empty"),
    "unknown session, no prompt": (_req(None, session_id="no-such-session-hostile"), NF, "unknown session"),
    "empty session id, resume": (_req(None, session_id="", resume_from=3), NF, "unknown session"),
    # negative or huge limits
    "max_tokens negative": (_req(max_tokens=-5), IA, "max_tokens"),
    "max_tokens int32 min": (_req(max_tokens=-(2**31)), IA, "max_tokens"),
    "max_tokens int32 max": (_req(max_tokens=INT32_MAX), IA, "context"),
    "k negative": (_req(k=-1), IA, "k must be"),
    "k int32 max": (_req(k=INT32_MAX), IA, "k must be"),
    "top_k negative": (_req(sampling=common_pb2.SamplingParams(temperature=1.0, top_k=-1)), IA, "top_k"),
    "top_k int32 min": (_req(sampling=common_pb2.SamplingParams(temperature=1.0, top_k=-(2**31))), IA, "top_k"),
    "resume_from negative": (_req(session_id="hostile-resume-negative", resume_from=-1), IA, "resume_from"),
    "resume_from int32 min": (_req(None, session_id="hostile-resume-min", resume_from=-(2**31)), IA, "resume_from"),
    "resume_from huge, unknown session": (_req(None, session_id="hostile-resume-unknown", resume_from=INT32_MAX),
                                          NF, "unknown session"),
}


def test_hostile_requests_with_a_good_token_get_the_right_status_and_the_coordinator_stays_healthy(
        redis_url, text_target, tmp_path):
    lm, tokenizer_dir = text_target
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token_hash(GOOD)}\n")
    auth = (("authorization", f"Bearer {GOOD}"),)
    outer = ServerSettings(token_file=str(tokens), max_message_bytes=PUBLIC_MAX_MESSAGE_BYTES)  # as `coordinator`
    sid = "hostile-existing-session"

    async def status(call):
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    async def scenario():
        async with local_stack(redis_url, lm, outer=outer, token=GOOD, tokenizer_dir=tokenizer_dir) as st:
            stub = st.client.stub
            r = aioredis.from_url(redis_url)
            try:
                keys_before = await r.dbsize()
                got = {}
                for name, (req, _, _) in CASES.items():  # unary and streaming both
                    got[name] = (await status(stub.Generate(req, timeout=30, metadata=auth)),
                                 await status(stub.GenerateStream(req, timeout=30, metadata=auth).read()))
                refused_keys = await r.dbsize() - keys_before
                # An existing session: a resume point past its end is refused, the session is unharmed.
                first = await stub.Generate(_req(max_tokens=6, session_id=sid), timeout=30, metadata=auth)
                got["resume_from huge, existing session"] = (
                    await status(stub.Generate(_req(None, session_id=sid, resume_from=INT32_MAX), timeout=30,
                                               metadata=auth)),
                    await status(stub.GenerateStream(_req(None, session_id=sid, resume_from=7), timeout=30,
                                                     metadata=auth).read()))
                again = await stub.Generate(_req(None, session_id=sid, resume_from=2), timeout=30, metadata=auth)
                # A huge top_k is no limit at all: the same seeded sample as top_k = 0.
                seeded = [await stub.Generate(_req(max_tokens=10, sampling=common_pb2.SamplingParams(
                    temperature=1.0, top_k=top_k, seed=11)), timeout=30, metadata=auth) for top_k in (INT32_MAX, 0)]
                async with grpc.aio.insecure_channel(st.coord.address) as ch:
                    health = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                normal = await stub.Generate(_req(None, text="hello there", max_tokens=16), timeout=30, metadata=auth)
                normal_stream = [c async for c in stub.GenerateStream(_req(None, text="hello there", max_tokens=16),
                                                                      timeout=30, metadata=auth)]
                return (got, refused_keys, first, again, seeded, health.status, normal, normal_stream,
                        len(st.core.runs))
            finally:
                await r.aclose()

    got, refused_keys, first, again, seeded, health, normal, normal_stream, runs_left = run(scenario(), 180)

    expected = {**{n: (code, words) for n, (_, code, words) in CASES.items()},
                "resume_from huge, existing session": (IA, "beyond")}
    wrong = []
    for name, (code, words) in expected.items():
        for how, (got_code, details) in zip(("unary", "stream"), got[name]):
            if (got_code != code or words not in details or len(details) >= 300 or "Traceback" in details
                    or "Error(" in details or "a" * 100 in details):  # never the hostile input echoed back
                wrong.append(f"{name} ({how}): {got_code.name} {details[:200]!r}, wanted {code.name} {words!r}")
    assert not wrong, "\n".join(wrong)
    assert refused_keys == 0, f"refused requests wrote {refused_keys} Redis keys"
    assert list(again.token_ids) == list(first.token_ids)[2:], "a refused resume harmed the session"
    assert list(seeded[0].token_ids) == list(seeded[1].token_ids) and len(seeded[0].token_ids) == 10
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert runs_left == 0, "a refused request left a run behind"

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = list(tok("hello there", add_special_tokens=True)["input_ids"])
    want = plain_generate(lm, [prompt], stop=StopConditions(max_new_tokens=16))[0].token_ids
    assert_greedy_equal(lm, prompt, normal.token_ids, want)
    assert normal.text == tok.decode(list(want), skip_special_tokens=True) and normal.text
    assert [t for c in normal_stream for t in c.token_ids] == list(normal.token_ids)
    assert "".join(c.text for c in normal_stream) == normal.text
