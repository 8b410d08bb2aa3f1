"""TLS on every port and mutual TLS inside (issue 16): certificates made at run time by a CA of
the test's own; real gRPC servers and a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.decode import plain_generate
from specdec.rpc.clients import ServiceClient
from specdec.rpc.security import ClientTLS, SecurityConfigError, ServerTLS
from specdec.rpc.serving import ServerSettings, start_server
from specdec.service.metrics import ServiceMetrics
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import local_stack, run
from tests.tlscerts import make_ca

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster's CA (servers and the coordinator's client certificate) and a stranger's CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "cluster-ca"), make_ca(d, "other-ca")
    return {"ca": ca, "server": ca.issue("server"), "coordinator": ca.issue("coordinator"),
            "stranger": other.issue("stranger")}


def _inner(pki) -> ServerSettings:
    cert, key = pki["server"]
    return ServerSettings(tls=ServerTLS(cert, key, client_ca=pki["ca"].cert))


def _upstream(pki, who: str = "coordinator") -> ClientTLS:
    cert, key = pki[who]
    return ClientTLS(ca=pki["ca"].cert, cert=cert, key=key)


def test_generation_over_tls_everywhere_equals_plain_decoding(redis_url, tiny_target, tiny_draft, pki):
    cert, key = pki["server"]

    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft, inner=_inner(pki), upstream_tls=_upstream(pki),
                               outer=ServerSettings(tls=ServerTLS(cert, key)),
                               client_tls=ClientTLS(ca=pki["ca"].cert)) as st:
            out = await st.client.generate(st.client.request(token_ids=PROMPT, max_tokens=24, method="draft"))
            plaintext = ServiceClient(st.coord.address)  # the coordinator's port speaks only TLS
            try:
                plain_ok = await plaintext.healthy()
            finally:
                await plaintext.close()
            return out, plain_ok

    out, plain_ok = run(scenario())
    want = plain_generate(tiny_target, [PROMPT], stop=StopConditions(max_new_tokens=24,
                                                                      eos_token_ids=tiny_target.eos_token_ids))[0]
    assert_greedy_equal(tiny_target, PROMPT, out.token_ids, want.token_ids)
    assert out.stats["drafted"] > 0 and out.stats["fallback_steps"] == 0, "the draft was not used over mutual TLS"
    assert not plain_ok, "a plaintext client reached the coordinator's TLS port"


def test_draft_and_target_refuse_peers_without_a_certificate_from_the_configured_ca(
        redis_url, tiny_target, tiny_draft, pki):
    async def health(address: str, tls):
        ch = grpc.aio.secure_channel(address, tls.credentials()) if tls else grpc.aio.insecure_channel(address)
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return reply.status
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await ch.close()

    peers = {"no client certificate": ClientTLS(ca=pki["ca"].cert),
             "a certificate from another CA": _upstream(pki, "stranger"),
             "plaintext": None,
             "the coordinator's certificate": _upstream(pki)}

    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft, inner=_inner(pki),
                               upstream_tls=_upstream(pki)) as st:
            return {svc: {name: await health(srv.address, tls) for name, tls in peers.items()}
                    for svc, srv in (("draft", st.drafts[0]), ("target", st.targets[0]))}

    got = run(scenario())
    for svc in ("draft", "target"):
        assert got[svc]["the coordinator's certificate"] == health_pb2.HealthCheckResponse.SERVING, got
        for name in ("no client certificate", "a certificate from another CA", "plaintext"):
            assert got[svc][name] == grpc.StatusCode.UNAVAILABLE, f"{svc} accepted a peer with {name}: {got}"


def test_plaintext_off_loopback_is_refused_unless_insecure_is_asked_for():
    async def start(**kw):
        srv = await start_server(ServerSettings(host="0.0.0.0", **kw), lambda s: None, [], ServiceMetrics("x"))
        await srv.stop(0)
        return srv.port

    with pytest.raises(SecurityConfigError, match="plaintext"):
        run(start())
    assert run(start(insecure=True)) > 0


def test_a_service_process_refuses_plaintext_off_loopback_before_loading_its_model():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "draft_service", "--host", "0.0.0.0", "--metrics-port", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to serve plaintext on 0.0.0.0" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def test_the_coordinator_refuses_plaintext_to_remote_replicas_unless_insecure():
    argv = [sys.executable, "-m", "coordinator", "--host", "127.0.0.1", "--redis-url", "redis://127.0.0.1:1/0",
            "--target-replicas", "10.1.2.3:50062", "--metrics-port", "-1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "plaintext to the draft/target replicas" in proc.stderr
