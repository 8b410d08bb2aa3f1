"""The wire: committed stubs match the protos, the layering rule holds, conversions round-trip,
and every service serves health, reflection and Prometheus metrics."""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Optional

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.errors import InvalidRequest
from specdec.rpc import convert
from specdec.rpc.serving import ServerSettings
from specdec.sessions import check_session_id, token_digest
from specdec.types import SamplingParams
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


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def test_only_specdec_rpc_imports_grpc_and_nothing_in_specdec_imports_redis():
    wire = {"grpc", "grpc_health", "grpc_reflection", "grpc_tools"}
    offenders = []
    for pkg in ("specdec", "draft_service", "target_service", "coordinator"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT)
            names = _imports(path)
            in_rpc = rel.parts[:2] == ("specdec", "rpc")
            if not in_rpc and any(_top(n) in wire or n.startswith("google.protobuf") for n in names):
                offenders.append(f"{rel} imports grpc/protobuf")
            if pkg == "specdec" and any(_top(n) == "redis" for n in names):
                offenders.append(f"{rel} imports redis")
    assert not offenders, offenders


def _core_modules() -> list[str]:
    """Every module of the core and of the service runtime (specdec outside the wire, specdec/rpc/,
    and the application, specdec/app/), entry points aside."""
    names = []
    for path in sorted((ROOT / "specdec").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] in (("specdec", "rpc"), ("specdec", "app")) or path.name == "__main__.py":
            continue
        names.append(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
    return names


# Imports each module in turn in a fresh interpreter and names the first one after which grpc,
# protobuf or redis is loaded (a later offender would be hidden by an earlier one: fix and rerun).
_LOADS = """
import importlib, json, sys
wire = ("grpc", "google.protobuf", "redis")
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded = [w for w in wire if w in sys.modules]
    if loaded:
        print(json.dumps([name, loaded]))
        break
"""


@pytest.mark.parametrize("group", ["specdec", "draft_service.core", "target_service.core", "coordinator.core"])
def test_the_core_and_each_services_core_load_neither_grpc_nor_redis(group):
    modules = _core_modules() if group == "specdec" else [group]
    out = subprocess.run([sys.executable, "-c", _LOADS, *modules], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out == "", f"importing {out.strip()} loads the wire"


def _first_party_imports() -> dict[str, set[str]]:
    """module -> the first-party modules it imports anywhere (top level, functions, TYPE_CHECKING)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in ("specdec", "draft_service", "target_service", "coordinator") for p in (ROOT / pkg).rglob("*.py")}

    def module_of(name: str) -> Optional[str]:  # "pkg.mod.attr" -> "pkg.mod"
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {module_of(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {module_of(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = found - {None, name}
    return graph


def test_first_party_modules_import_one_another_without_a_circle():
    try:
        tuple(graphlib.TopologicalSorter(_first_party_imports()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_draft_probs_round_trip_exactly_sparse_and_dense():
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(3, 50, generator=gen).softmax(-1)  # full support: packed float32
    sparse = dense.clone()
    sparse[:, 5:] = 0.0  # top-k style support: sparse rows
    sparse = sparse / sparse.sum(-1, keepdim=True)
    for probs, kind in ((dense, "dense_f32"), (sparse, "sparse")):
        msg = convert.draft_probs_to_pb(probs)
        assert msg.WhichOneof("encoding") == kind
        assert torch.equal(convert.draft_probs_from_pb(msg, 3, 50), probs.float())
    with pytest.raises(InvalidRequest):
        convert.draft_probs_from_pb(convert.draft_probs_to_pb(dense), 2, 50)


def test_sampling_params_round_trip_with_and_without_a_seed():
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=42)):
        assert convert.sampling_from_pb(convert.sampling_to_pb(params)) == params


def test_session_ids_are_validated_strictly():
    assert check_session_id("abc-DEF_123") == "abc-DEF_123"
    for bad in ("short", "has space in it", "../../etc/passwd", "a" * 65, "ключ-сессии-1", "x\ny" * 5, ""):
        with pytest.raises(InvalidRequest):
            check_session_id(bad)


def test_token_digest_depends_on_every_token_and_the_order():
    base = token_digest([1, 2, 3])
    assert base == token_digest((1, 2, 3))
    assert base != token_digest([1, 2, 4]) and base != token_digest([3, 2, 1])
    assert base != token_digest([1, 2, 3, 0])


def test_prefix_digests_follow_a_token_list_that_grows_and_is_cut_back():
    import random

    from specdec.sessions import PrefixDigests, extend_digest

    rng = random.Random(0)
    tokens: list[int] = []
    digests = PrefixDigests()
    for _ in range(200):
        if tokens and rng.random() < 0.3:  # a rollback, then other tokens
            keep = rng.randrange(len(tokens) + 1)
            new = tokens[:keep] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            digests.reset(new, keep)
            tokens = new
        else:
            step = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            assert extend_digest(digests.last(), step) == token_digest(tokens + step)
            digests.extend(step)
            tokens += step
        assert len(digests) == len(tokens)
        n = rng.randrange(len(tokens) + 1)
        assert digests.at(n) == token_digest(tokens[:n]) and digests.last() == token_digest(tokens)


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


def test_common_prefix_len_counts_the_shared_leading_tokens_of_lists_and_tuples():
    import random

    from specdec.verify import common_prefix_len

    rng = random.Random(1)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(30))]
        b = [rng.randrange(3) for _ in range(rng.randrange(30))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(tuple(a), b) == common_prefix_len(a, tuple(b)) == want
