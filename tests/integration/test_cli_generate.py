"""`specdec generate` on the embedded target as a user runs it: the answer streamed to stdout
then one stats line, no progress bars, and the cost measurement done once per machine."""

import json
import os
import subprocess
import sys

import pytest

from specdec.engine import Engine, EngineConfig
from specdec.models import default_cache_dir
from specdec.types import StopConditions

pytestmark = pytest.mark.real_model

PROMPT = "What is the capital of France?"


def _generate(cache_home, *args):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--max-new-tokens", "24", *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.fixture()
def cache_home(tmp_path, real):
    """A fresh user cache folder whose converted model is the one already made (no 30 s conversion)."""
    (tmp_path / "specdec").mkdir()
    (tmp_path / "specdec" / "models").symlink_to(default_cache_dir(), target_is_directory=True)
    return tmp_path


def _backend_choice(cache_home) -> dict:
    [path] = (cache_home / "specdec" / "costs").glob("backend_choice-*.json")
    return json.loads(path.read_text())["value"]


def test_generate_prints_the_answer_then_one_stats_line_and_no_progress_bars(cache_home, real):
    first_out, first_err = _generate(cache_home)  # a fresh machine: picks its backend once
    said = first_err.splitlines()
    assert said[0].startswith("specdec: measuring whether llama.cpp runs correctly here"), first_err  # its probe
    assert said[1].startswith("specdec: measuring which backend runs the target fastest"), first_err
    stdout, stderr = _generate(cache_home)
    assert stderr == "", stderr  # no "Loading weights" bar, no warnings, nothing measured again
    assert stdout.split("\n[")[0] == first_out.split("\n[")[0]  # the same answer
    *answer, stats = stdout.rstrip("\n").split("\n")
    chosen = _backend_choice(cache_home)
    faster = min(("fast", "llamacpp"), key=lambda b: chosen[b]["request_s"])
    assert chosen["choice"] == faster  # (which one wins depends on the host: not asserted)
    want = Engine(EngineConfig(backend=faster)).complete(PROMPT, stop=StopConditions(max_new_tokens=24)).text
    # (Not "Paris" on llama.cpp: its quantized arithmetic answers "L'Étoile, ..." here, as
    # llama-cpp-python's own chat completion does; the float32 fast path answers "Paris".)
    assert "\n".join(answer) == want and want
    assert stats.startswith("[auto: ") and f" on {faster}] " in stats and "tok/s" in stats
    # The library's default engine means the same by auto: the same measured choice, read from the same costs.
    assert Engine(EngineConfig(cost_cache=cache_home / "specdec" / "costs")).backend == faster


def test_generate_measures_costs_once_per_machine_and_reuses_them(cache_home):
    first_out, first_err = _generate(cache_home, "--method", "prompt-lookup")
    assert "measuring the verify cost" in first_err
    assert list((cache_home / "specdec" / "costs").glob("verify_cost-*.json"))
    second_out, second_err = _generate(cache_home, "--method", "prompt-lookup")
    assert second_err == "", second_err
    assert second_out.split("\n[")[0] == first_out.split("\n[")[0]  # same answer either way


def test_tree_methods_run_on_torch_under_backend_auto(cache_home):
    out, _ = _generate(cache_home, "--method", "lookahead")
    assert "Paris" in out and "\n[lookahead on fast] " in out
    assert not list((cache_home / "specdec" / "costs").glob("backend_choice-*.json"))  # nothing to choose
