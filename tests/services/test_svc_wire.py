"""The wire: committed stubs match the protos, and every service serves health, reflection and
Prometheus metrics (the layering rules: tests/unit/test_import_graph.py; conversions:
tests/unit/test_convert.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.rpc.serving import ServerSettings
from target_service.servicer import start_target_server
from tests.services.stack import run

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specdec" / "rpc" / "v1").glob("*_pb2*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "specdec" / "rpc" / "v1").glob("*_pb2*"))
    assert fresh == committed, "stub files differ: run scripts/gen_protos.sh"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} drifted: run scripts/gen_protos.sh"


def test_a_service_serves_health_reflection_and_metrics(tiny_target):
    async def scenario():
        srv = await start_target_server(tiny_target, ServerSettings(metrics_port=0))
        try:
            async with grpc.aio.insecure_channel(srv.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
                            for s in ("", "specdec.rpc.v1.TargetService")]
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                replies = [r async for r in refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
                services = {s.name for s in replies[0].list_services_response.service}
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
            await srv.stop(0.5)
            return statuses, services, metrics, srv
        finally:
            await srv.stop(0)

    statuses, services, metrics, srv = run(scenario())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert {"specdec.rpc.v1.TargetService", "grpc.health.v1.Health"} <= services
    for name in ("specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
                 "specdec_spec_decode_num_accepted_tokens_total", "specdec_request_latency_seconds",
                 "specdec_queue_depth", "specdec_batch_size"):
        assert name in metrics


def test_shutdown_sets_health_not_serving_before_the_server_stops(tiny_target):
    async def scenario():
        srv = await start_target_server(tiny_target)
        stopping = __import__("asyncio").ensure_future(srv.stop(grace=1.0))
        await __import__("asyncio").sleep(0.05)
        status = (await srv.health.Check(health_pb2.HealthCheckRequest(service=""), None)).status
        await stopping
        return status

    assert run(scenario()) == health_pb2.HealthCheckResponse.NOT_SERVING
