"""Shared fixtures: tiny seeded models built in code (no downloads) and the helpers that
compare speculative output with plain output token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch

from specdec.costmodel import CostStore
from specdec.decode import plain_generate
from specdec.backends.hf import CausalLM
from specdec.testing import perturbed_copy, tiny_llama
from specdec.types import StopConditions

TIE_TOLERANCE = 1e-4


@pytest.fixture(scope="session", autouse=True)
def suite_cache_home(tmp_path_factory):
    """The suite's own user cache folder ($XDG_CACHE_HOME), inherited by every process it starts:
    the timings it takes on a machine it keeps busy itself never reach the user's cost store,
    which `specdec generate` and `specdec up` read. The converted models are the user's (linked)."""
    from specdec.models import user_cache_dir

    home = tmp_path_factory.mktemp("cache-home")
    models = user_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "specdec").mkdir()
    (home / "specdec" / "models").symlink_to(models, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(home))
    yield home
    patch.undo()


def quiet(measure):
    """A CostStore load reading that says the machine was quiet (tests about keys and files)."""
    return measure(), 0.0


@pytest.fixture(scope="session")
def tiny_target() -> CausalLM:
    return tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target) -> CausalLM:
    """Agrees with the target often but not always, so both accept and reject paths run."""
    return perturbed_copy(tiny_target, noise=0.25, seed=1)


def gguf_copy(lm: CausalLM, path: Path, threads: int = 1, context=None, n_batch: int = 512):
    """The same weights written as a GGUF file at `path` (float32) and loaded on llama.cpp, after
    its probe (a child process): a llama.cpp build that crashes fails the test with one line
    instead of killing the test run. n_batch: tokens a llama_decode holds (its prefill block)."""
    from specdec.backends.llamacpp import LlamaCppLM
    from specdec.backends.llamacpp.convert import write_llama_gguf
    from specdec.backends.llamacpp.probe import require_usable, torch_reference
    from specdec.models import user_cost_store

    path = write_llama_gguf(lm.model, path)
    require_usable(path, user_cost_store(), torch_reference(lm))
    return LlamaCppLM(path, threads=threads, context=context, n_batch=n_batch)


# Verify-cost curves for tests of rules that read v(k) (not this host's):
GPU_LIKE_COST = {1: 1.0, 64: 1.05}  # a GPU: a forward over 64 tokens costs about one
LLAMACPP_CPU_COST = {1: 1.0, 2: 1.9, 3: 2.8, 5: 4.6, 9: 8.0}  # llama.cpp on a CPU: k tokens cost ~k steps


class FixedCosts(CostStore):
    """A cost store whose verify-cost curve is given: tests of a rule that reads v(k), not of
    this machine."""

    def __init__(self, curve: dict[int, float]):
        super().__init__()
        self.curve = curve

    def verify_cost(self, lm) -> dict[int, float]:
        return dict(self.curve)


def plain(lm, prompt: Sequence[int], n: int):
    """Plain greedy decoding of one prompt (up to n new tokens, stopping at the model's EOS): the
    reference every lossless greedy output equals. -> its GenerationResult."""
    return plain_generate(lm, [list(prompt)], stop=StopConditions(max_new_tokens=n, eos_token_ids=lm.eos_token_ids))[0]


def full_logits(lm: CausalLM, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of one plain causal forward over ids."""
    cache = lm.new_cache(1)
    return lm.forward(cache, torch.tensor([list(ids)])).logits[0]


def assert_greedy_equal(lm: CausalLM, prompt: Sequence[int], got: Sequence[int], want: Sequence[int],
                        tolerance: float = TIE_TOLERANCE) -> None:
    """got must equal want token for token. A divergence is tolerated only at a position where
    the plain run's top-two logits tie within `tolerance` (k-token vs 1-token float rounding);
    nothing after such a position can be compared."""
    got, want = list(got), list(want)
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if j is None:
        assert len(got) == len(want), f"same prefix but lengths differ: {len(got)} vs {len(want)}"
        return
    logits = full_logits(lm, list(prompt) + want[:j])[-1]
    top2 = torch.topk(logits.float(), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < tolerance, (
        f"speculative output diverges at generated token {j}: {got[j]} vs {want[j]} "
        f"(plain top-two logit gap {gap:.3g} is not a tie)")


def check_greedy(target, proposer, prompts, stop, k):
    """speculative_generate with this proposer equals plain decoding on every prompt (tie-aware),
    and stops for the same reason -> its results."""
    from specdec.decode import plain_generate, speculative_generate

    want = [plain_generate(target, [p], stop=stop)[0] for p in prompts]
    got = speculative_generate(target, proposer, prompts, stop=stop, k=k)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(target, p, g.token_ids, w.token_ids)
        assert g.finish_reason == w.finish_reason
    return got
