"""`--backend auto`: the faster backend is measured once per machine and file, then only it is
loaded; methods with tree blocks stay on torch; method "auto" falls back to plain where the
target's measured verify cost leaves speculation nothing to gain."""

import time

import pytest
import torch

from specdec.backends.choice import load_faster
from specdec.costmodel import CostStore
from specdec.engine import Engine
from specdec.models import LoadedModel
from specdec.proposers import needs_trees
from specdec.types import StopConditions
from tests.conftest import FixedCosts, quiet


class BusyLM:
    """A model that burns `busy_s` of CPU in every call (CPU time: what the measurement counts
    when torch runs one thread)."""

    def __init__(self, lm, busy_s: float):
        self._lm, self._busy_s = lm, busy_s

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def _burn(self):
        end = time.thread_time() + self._busy_s
        while time.thread_time() < end:
            pass

    def forward(self, *args, **kwargs):
        self._burn()
        return self._lm.forward(*args, **kwargs)

    def prefill(self, *args, **kwargs):
        self._burn()
        return self._lm.prefill(*args, **kwargs)


@pytest.fixture()
def one_thread():
    """Measurements count CPU time when torch runs one thread (as `--threads 1` does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # only its identity is read here
    return path


def _USABLE() -> None:
    """llama.cpp's probe passed (these tests measure the choice, not the probe: test_llamacpp_probe.py)."""


def _loaders(tiny_target, slow: str, calls: list):
    def load(name):
        def go():
            calls.append(name)
            lm = BusyLM(tiny_target, 0.004) if name == slow else tiny_target
            return LoadedModel(lm=lm, tokenizer=None, path=name)
        return go
    return {"fast": load("fast"), "llamacpp": load("llamacpp")}


@pytest.mark.parametrize("slow,want", [("fast", "llamacpp"), ("llamacpp", "fast")])
def test_auto_picks_the_backend_that_serves_a_request_faster(tiny_target, gguf_file, tmp_path, slow, want, one_thread):
    calls: list = []
    got = load_faster(gguf_file, CostStore(tmp_path / "costs", others_busy=quiet), _loaders(tiny_target, slow, calls), _USABLE)
    assert got.path == want
    assert sorted(calls) == ["fast", "llamacpp"]  # both measured the first time


def test_the_choice_is_kept_and_later_runs_load_only_the_chosen_backend(tiny_target, gguf_file, tmp_path, one_thread):
    load_faster(gguf_file, CostStore(tmp_path / "costs", others_busy=quiet), _loaders(tiny_target, "fast", []), _USABLE)
    calls: list = []
    got = load_faster(gguf_file, CostStore(tmp_path / "costs", others_busy=quiet), _loaders(tiny_target, "llamacpp", calls), _USABLE)
    assert got.path == "llamacpp" and calls == ["llamacpp"]  # not measured again, the other never loaded
    # Another GGUF file (or machine, or thread count) is measured again.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(7))
    calls.clear()
    assert load_faster(other, CostStore(tmp_path / "costs", others_busy=quiet), _loaders(tiny_target, "llamacpp", calls), _USABLE).path == "fast"
    assert sorted(calls) == ["fast", "llamacpp"]


def test_only_lookahead_needs_tree_blocks():
    assert needs_trees("lookahead")  # its Jacobi window rides beside the candidates; Medusa can run a chain
    assert not any(needs_trees(m) for m in ("plain", "prompt-lookup", "draft", "medusa", "auto"))


@pytest.mark.parametrize("curve,want", [
    ({1: 1.0, 2: 1.05, 3: 1.6, 5: 2.4, 9: 3.5}, "prompt-lookup"),  # a float32 forward on a CPU: 2 tokens ~ 1
    ({1: 1.0, 2: 2.3, 3: 3.2, 5: 5.2, 9: 7.3}, "plain"),  # llama.cpp on a CPU: k tokens ~ k steps
    ({1: 1.0, 2: 1.44, 3: 1.8, 5: 2.2, 9: 3.6}, "plain"),  # llama.cpp, 2 threads: a predicted 1.04x is no margin
    ({1: 1.0, 2: 1.0, 5: 1.0, 9: 1.01, 17: 1.02}, "prompt-lookup"),  # a GPU
])
def test_method_auto_speculates_only_where_the_verify_cost_lets_it_pay(tiny_target, curve, want):
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), costs=FixedCosts(curve))
    assert engine.resolve_method("auto") == want
    prompt = [5, 17, 33, 2, 40, 5, 17, 33]
    stop = StopConditions(max_new_tokens=16)
    got = engine.generate_ids([prompt], "auto", stop=stop, k="auto")[0]
    plain = engine.generate_ids([prompt], "plain", stop=stop)[0]
    assert got.token_ids == plain.token_ids
    if want == "plain":
        assert got.stats.drafted == 0  # no probing either
