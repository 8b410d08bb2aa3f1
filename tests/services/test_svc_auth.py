"""Bearer tokens at the coordinator (issue 16): a missing, wrong or revoked token ends the call
UNAUTHENTICATED before any handler work and before any Redis key is touched; health needs no
token; reflection is off unless enabled; the token file is re-read when it changes. Real gRPC
servers, a real redis-server, `specdec client` as a real process."""

from __future__ import annotations

import asyncio
import os
import sys

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.rpc.clients import CoordinatorClient
from specdec.rpc.security import UNAUTHENTICATED, token_hash
from specdec.rpc.serving import ServerSettings
from tests.services.stack import local_stack, run, status_of

PROMPT = [5, 6, 7, 8]
GOOD, REVOKED, LATER = "good-token-0123456789", "revoked-token-abcdef", "added-later-token-xyz"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _write_tokens(path, *tokens: str) -> None:
    tmp = path.with_suffix(".tmp")  # replaced whole, as an editor or a Secret update does
    tmp.write_text("# accepted bearer tokens (sha256)\n" + "".join(f"{token_hash(t)}\n" for t in tokens))
    os.replace(tmp, path)


def test_missing_wrong_or_revoked_tokens_are_refused_before_any_handler_or_redis_work(redis_url, long_target,
                                                                                     tmp_path):
    tokens = tmp_path / "tokens"
    _write_tokens(tokens, GOOD, REVOKED)

    async def scenario():
        async with local_stack(redis_url, long_target, outer=ServerSettings(token_file=str(tokens)),
                               token=GOOD) as st:
            opened = []
            real_open = st.core.open

            async def counting_open(req, stream=True):  # a spy on the real handler work: counts, then does it
                opened.append(req.session_id)
                return await real_open(req, stream)

            st.core.open = counting_open
            r = aioredis.from_url(redis_url)
            stub = st.client.stub

            def req(sid):
                return CoordinatorClient.request(token_ids=PROMPT, max_tokens=6, session_id=sid)

            async def unary(sid, token=None):
                md = (("authorization", f"Bearer {token}"),) if token is not None else None
                return await status_of(stub.Generate(req(sid), timeout=10, metadata=md))

            async def stream(sid, token=None):
                md = (("authorization", f"Bearer {token}"),) if token is not None else None
                return await status_of(stub.GenerateStream(req(sid), timeout=10, metadata=md).read())

            try:
                keys_before = await r.dbsize()
                refused = {
                    "missing": await unary("auth-missing"),
                    "missing, stream": await stream("auth-missing-stream"),
                    "wrong": await unary("auth-wrong", "not-a-token"),
                    "empty": await unary("auth-empty", ""),
                    "not bearer": await status_of(stub.Generate(req("auth-basic"), timeout=10,
                                                            metadata=(("authorization", f"Basic {GOOD}"),))),
                }
                refused_keys = await r.dbsize() - keys_before
                refused_opens = len(opened)
                before_revoke = await unary("auth-revoked-ok", REVOKED)
                _write_tokens(tokens, GOOD, LATER)  # revoke one, add one: no restart
                refused["revoked"] = await unary("auth-revoked-after", REVOKED)
                refused["revoked, stream"] = await stream("auth-revoked-after-stream", REVOKED)
                later = await unary("auth-later", LATER)
                good = await st.client.generate(req("auth-good"))  # the client's own token
                exists = {sid: await r.exists("specdec:session:" + sid)
                          for sid in ("auth-missing", "auth-wrong", "auth-revoked-after", "auth-good")}
                return refused, refused_keys, refused_opens, before_revoke, later, good, opened, exists
            finally:
                await r.aclose()

    refused, refused_keys, refused_opens, before_revoke, later, good, opened, exists = run(scenario())

    for name, (code, details) in refused.items():
        assert code == grpc.StatusCode.UNAUTHENTICATED, f"{name}: {code} {details}"
        assert details == UNAUTHENTICATED, f"{name}: {details!r}"
    assert refused_opens == 0, "a refused call reached the coordinator's handler"
    assert refused_keys == 0, "a refused call wrote to Redis"
    assert before_revoke[0] == grpc.StatusCode.OK and later[0] == grpc.StatusCode.OK
    assert good.token_ids and good.finish_reason == "length"
    assert opened == ["auth-revoked-ok", "auth-later", "auth-good"]
    assert exists == {"auth-missing": 0, "auth-wrong": 0, "auth-revoked-after": 0, "auth-good": 1}


def test_health_needs_no_token_and_reflection_is_off_unless_enabled(redis_url, long_target, tmp_path):
    tokens = tmp_path / "tokens"
    _write_tokens(tokens, GOOD)

    async def probe(address):
        async with grpc.aio.insecure_channel(address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="specdec.rpc.v1.Coordinator"), timeout=5)
            refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5,
                metadata=(("authorization", f"Bearer {GOOD}"),))
            return health.status, await status_of(refl.read())

    async def scenario():
        got = {}
        for reflection in (False, True):
            outer = ServerSettings(token_file=str(tokens), reflection=reflection)
            async with local_stack(redis_url, long_target, outer=outer) as st:
                got[reflection] = await probe(st.coord.address)
        return got

    got = run(scenario())
    assert got[False][0] == health_pb2.HealthCheckResponse.SERVING
    assert got[False][1][0] == grpc.StatusCode.UNIMPLEMENTED, "reflection served though not enabled"
    assert got[True][1][0] == grpc.StatusCode.OK, "reflection not served though enabled (with a valid token)"


def test_specdec_client_sends_the_token_from_a_file_or_the_environment(redis_url, long_target, tmp_path):
    tokens = tmp_path / "tokens"
    _write_tokens(tokens, GOOD)
    token_file = tmp_path / "my-token"
    token_file.write_text(GOOD + "\n")

    async def cli(*args, env=ENV):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specdec", "client", *args, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        return proc.returncode, out.decode(), err.decode()

    async def scenario():
        async with local_stack(redis_url, long_target, outer=ServerSettings(token_file=str(tokens))) as st:
            common = ("hello", "--no-chat", "--max-new-tokens", "4", "--address", st.coord.address,
                      "--connect-timeout", "10")
            return (await cli(*common, "--token-file", str(token_file)),
                    await cli(*common, env=dict(ENV, SPECDEC_TOKEN=GOOD)),
                    await cli(*common, env={k: v for k, v in ENV.items() if k != "SPECDEC_TOKEN"}))

    by_file, by_env, without = run(scenario())
    # The tiny target serves no tokenizer: a text prompt is refused by the handler (INVALID_ARGUMENT),
    # which shows the token got the call past authentication.
    for rc, out, err in (by_file, by_env):
        assert rc == 2 and "send token ids" in err and "bearer token" not in err, err
    assert without[0] == 2 and "missing or invalid bearer token" in without[2], without
    assert "Traceback" not in by_file[2] + by_env[2] + without[2]
