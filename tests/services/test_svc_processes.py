"""The three services as real processes (`python -m ...`, settings from flags and a TOML file),
a real redis-server, tiny models saved to disk: greedy output equals plain decoding, metrics
are served, and SIGTERM shuts a service down cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from specdec.decode import plain_generate
from specdec.models import load_model
from specdec.testing import perturbed_copy, tiny_llama
from specdec.rpc.clients import CoordinatorClient, ServiceClient
from specdec.app.launcher import _wait_serving, free_port, guarded, stop_processes
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22]]


@pytest.fixture
def model_dirs(tmp_path):
    target = tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48)
    draft = perturbed_copy(target, noise=0.1, seed=2)
    target.model.save_pretrained(tmp_path / "target")
    draft.model.save_pretrained(tmp_path / "draft")
    return str(tmp_path / "target"), str(tmp_path / "draft")


def test_services_as_processes_match_plain_decoding_and_stop_on_sigterm(tmp_path, redis_url, model_dirs):
    target_dir, draft_dir = model_dirs
    ports = {name: free_port() for name in ("coord", "draft", "target", "m_coord", "m_draft", "m_target")}
    config = tmp_path / "target.toml"
    config.write_text(f'target = "{target_dir}"\nmax_batch = 4\nbatch_window_ms = 1.0\nport = {ports["target"]}\n')
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = sys.executable
    argv = {
        "target": [py, "-m", "target_service", "--config", str(config), "--host", "127.0.0.1",
                   "--metrics-port", str(ports["m_target"]), "--grace-period", "2"],
        "draft": [py, "-m", "draft_service", "--host", "127.0.0.1", "--port", str(ports["draft"]),
                  "--metrics-port", str(ports["m_draft"]), "--draft", draft_dir],
        "coordinator": [py, "-m", "coordinator", "--host", "127.0.0.1", "--port", str(ports["coord"]),
                        "--metrics-port", str(ports["m_coord"]), "--redis-url", redis_url,
                        "--draft-replicas", f"127.0.0.1:{ports['draft']}",
                        "--target-replicas", f"127.0.0.1:{ports['target']}"],
    }
    health = {"target": "specdec.rpc.v1.TargetService", "draft": "specdec.rpc.v1.DraftService",
              "coordinator": "specdec.rpc.v1.Coordinator"}
    port_of = {"target": ports["target"], "draft": ports["draft"], "coordinator": ports["coord"]}
    procs = {name: subprocess.Popen(guarded(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, cmd in argv.items()}
    try:
        async def scenario():
            for name, proc in procs.items():
                await _wait_serving(f"127.0.0.1:{port_of[name]}", health[name], proc, timeout=120)
            # the coordinator learns that the draft serves from its own health probes (its metrics say when)
            live, coord_metrics = 'specdec_replicas_live{service="draft"} 1.0', f"http://127.0.0.1:{ports['m_coord']}/metrics"
            for _ in range(200):
                if live in urllib.request.urlopen(coord_metrics, timeout=5).read().decode():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the coordinator never counted the draft replica live")
            client = CoordinatorClient(f"127.0.0.1:{ports['coord']}")
            try:
                # method draft: auto may decode a short answer on the target alone (its first step)
                outs = await asyncio.gather(*(client.generate(client.request(token_ids=p, max_tokens=20,
                                                                             method="draft"))
                                              for p in PROMPTS))
            finally:
                await client.close()
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['m_target']}/metrics", timeout=5).read()
            procs["target"].send_signal(signal.SIGTERM)
            probe = ServiceClient(f"127.0.0.1:{ports['target']}")
            try:
                serving_after_term = await probe.healthy()
            finally:
                await probe.close()
            return outs, metrics.decode(), serving_after_term

        outs, metrics, serving_after_term = asyncio.run(scenario())
        target = load_model(target_dir).lm
        for p, out in zip(PROMPTS, outs):
            want = plain_generate(target, [p], stop=StopConditions(max_new_tokens=20,
                                                                   eos_token_ids=target.eos_token_ids))[0]
            assert_greedy_equal(target, p, out.token_ids, want.token_ids)
        assert sum(o.stats["drafted"] for o in outs) > 0
        assert "specdec_spec_decode_num_draft_tokens_total" in metrics
        assert not serving_after_term
        assert procs["target"].wait(timeout=30) == 0, procs["target"].stderr.read().decode()[-2000:]
    finally:
        stop_processes(list(procs.values()), 15)


def test_service_flags_can_come_from_a_toml_file_and_flags_override_it(tmp_path):
    from coordinator.__main__ import build_parser as coordinator_parser
    from specdec.rpc.serving import parse_settings
    from target_service.__main__ import build_parser as target_parser

    cfg = tmp_path / "c.toml"
    cfg.write_text('redis_url = "redis://r:6379/0"\nsession_ttl = 60\ntarget_replicas = "a:1,b:2"\n')
    args = parse_settings(coordinator_parser(), ["--config", str(cfg), "--session-ttl", "30"])
    assert (args.redis_url, args.session_ttl, args.target_replicas) == ("redis://r:6379/0", 30, "a:1,b:2")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_batchh = 3\n")
    with pytest.raises(SystemExit):
        parse_settings(target_parser(), ["--config", str(bad)])


@pytest.mark.parametrize("module", ["draft_service", "target_service"])
def test_services_refuse_a_bad_device_before_loading_anything(module, capsys):
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    assert main(["--device", "gpu0", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{module}: error: unknown device 'gpu0'; use auto, cpu, cuda or cuda:N"
