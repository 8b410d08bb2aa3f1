"""llama.cpp's first run on a machine and build is a probe in a child process: a child that dies
by a signal, hangs, or computes wrong tokens marks llama.cpp unusable (kept in the cost store);
`--backend auto` then runs the float32 path and says why, an explicit `--backend llamacpp`, the
target service and `specdec cost-curve` exit 2 with that line. The children here are real
processes (one that dies by SIGSEGV, one that sleeps past its deadline, the real probe)."""

from __future__ import annotations

import functools
import sys

import pytest

from specdec.backends.choice import faster_backend
from specdec.costmodel import CostStore
from specdec.backends.llamacpp import model as llmodel
from specdec.backends.llamacpp.convert import write_llama_gguf
from specdec.backends.llamacpp.probe import ChildRun, LlamaCppUnusable, judge, probe, require_usable, spawn_child, torch_reference
from specdec.models import LoadedModel
from specdec.testing import tiny_llama

SEGV = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]
HANG = [sys.executable, "-c", "import time; time.sleep(60)"]


def _spawn(argv, deadline_s=30.0):
    return functools.partial(spawn_child, argv=argv, deadline_s=deadline_s)


def _never(path):
    raise AssertionError("the verdict should have been read from the store, not probed again")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_target, tmp_path_factory):
    return write_llama_gguf(tiny_target.model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_child_killed_by_sigsegv_marks_llamacpp_unusable_and_the_store_remembers(tiny_gguf, tmp_path):
    verdict = probe(tiny_gguf, CostStore(tmp_path), spawn=_spawn(SEGV))
    assert not verdict.ok and "SIGSEGV" in verdict.detail
    # Remembered, in this process and the next (a new store on the same folder): no second child.
    with pytest.raises(LlamaCppUnusable, match=r"SIGSEGV.*bootstrap\.sh"):
        require_usable(tiny_gguf, CostStore(tmp_path), spawn=_never)


def test_a_child_that_hangs_is_killed_at_its_deadline_and_marks_llamacpp_unusable(tiny_gguf, tmp_path):
    verdict = probe(tiny_gguf, CostStore(tmp_path), spawn=_spawn(HANG, deadline_s=1.0))
    assert not verdict.ok and "hung" in verdict.detail


def test_another_build_of_llamacpp_is_probed_again(tiny_gguf, tmp_path, monkeypatch):
    assert not probe(tiny_gguf, CostStore(tmp_path), spawn=_spawn(SEGV)).ok
    monkeypatch.setattr(llmodel, "build_identity", lambda: "another-build")  # as after a rebuild
    assert probe(tiny_gguf, CostStore(tmp_path)).ok  # the real probe, in a real child


def test_the_real_probe_agrees_with_the_same_weights_on_torch(tiny_target, tiny_gguf, tmp_path):
    verdict = probe(tiny_gguf, CostStore(tmp_path), reference=torch_reference(tiny_target))
    assert verdict.ok, verdict.detail


def test_a_child_whose_greedy_tokens_disagree_with_the_reference_marks_llamacpp_unusable(tiny_gguf, tmp_path):
    other = tiny_llama(seed=7, vocab_size=96, num_layers=2, hidden_size=48)  # other weights: as a broken kernel
    verdict = probe(tiny_gguf, CostStore(tmp_path), reference=torch_reference(other))
    assert not verdict.ok and "wrong tokens" in verdict.detail


def test_judge_reads_the_outcomes_a_child_can_have():
    top = [[[3, 5.0], [4, 4.9], [7, 1.0]]]
    good = '{"prompt": [1], "greedy": [3], "top": %s, "block_top": %s}' % (top, top)
    assert judge(ChildRun(0, good)).ok
    assert judge(ChildRun(0, good), reference=[4]).ok  # a near-tie: 0.1 apart in llama.cpp's own logits
    assert "wrong tokens" in judge(ChildRun(0, good), reference=[7]).detail  # 4.0 apart: not a tie
    off = '{"prompt": [1], "greedy": [3], "top": %s, "block_top": [[[7, 9.0], [3, 2.0]]]}' % (top,)
    assert "batched forward disagrees" in judge(ChildRun(0, off)).detail
    assert "SIGILL" in judge(ChildRun(-4)).detail
    assert "code 3: no such file" in judge(ChildRun(3, "", "loading\nno such file")).detail
    assert "no result" in judge(ChildRun(0, "garbage")).detail


def test_backend_auto_falls_back_to_the_float32_path_and_says_why(tiny_target, tiny_gguf, tmp_path):
    said = []
    costs = CostStore(tmp_path, notify=said.append)
    assert not probe(tiny_gguf, costs, spawn=_spawn(SEGV)).ok
    loaded = []

    def loader(name):
        return lambda: loaded.append(name) or LoadedModel(tiny_target, None, name)

    choice = faster_backend(tiny_gguf, costs, {"fast": loader("fast"), "llamacpp": loader("llamacpp")})
    assert choice == "fast" and "llamacpp" not in loaded
    assert any("SIGSEGV" in line and "backend fast" in line for line in said)


@pytest.fixture()
def crashing_default(tmp_path, monkeypatch):
    """The embedded default's GGUF, with a SIGSEGV probe verdict kept in the user's cache folder."""
    from specdec.models import embedded_gguf_path, user_cost_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert not probe(embedded_gguf_path(), user_cost_store(), spawn=_spawn(SEGV)).ok


@pytest.mark.parametrize("argv", [
    ["generate", "Write a haiku about the sea.", "--backend", "llamacpp", "--max-new-tokens", "4"],
    ["cost-curve", "--backend", "llamacpp", "--ks", "1-2"],
])
def test_an_explicit_llamacpp_backend_exits_2_with_the_line(crashing_default, capsys, argv):
    from specdec.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "llama.cpp is unusable" in err and "SIGSEGV" in err and "Traceback" not in err


def test_the_target_service_refuses_to_start_on_a_crashing_llamacpp(crashing_default, capsys):
    from target_service.__main__ import main

    assert main(["--host", "127.0.0.1", "--backend", "llamacpp", "--port", "0", "--metrics-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp is unusable" in err and "SIGSEGV" in err
