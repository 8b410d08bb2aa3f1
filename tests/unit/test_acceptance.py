"""Rejection sampling on tiny vocabularies: the emitted token is distributed exactly as the
target, and the acceptance rate is 1 - TV(draft, target)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.acceptance import greedy_accept, rejection_sample
from specdec.sampling import make_generator

N_SAMPLES = 20_000


def _run(draft_probs, target_probs, n=N_SAMPLES, seed=0, deterministic_token=None):
    """Draft one token (k = 1) n times; histogram the first emitted token and count acceptances."""
    gen = make_generator(seed)
    vocab = target_probs.shape[-1]
    counts = np.zeros(vocab)
    accepted = 0
    target2 = torch.stack([target_probs, target_probs])  # [k + 1, vocab]; the bonus row is not under test
    for _ in range(n):
        if deterministic_token is None:
            tok = torch.multinomial(draft_probs, 1, generator=gen)
            dp = draft_probs[None]
        else:
            tok = torch.tensor([deterministic_token])
            dp = None
        a, nxt = rejection_sample(tok, dp, target2, gen)
        first = int(tok[0]) if a == 1 else nxt
        counts[first] += 1
        accepted += a
    return counts, accepted / n


def _assert_matches(counts, target_probs):
    probs = target_probs.double().numpy()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = probs[support] / probs[support].sum() * counts.sum()
    p = chisquare(counts[support], expected).pvalue
    assert p > 0.001, f"emitted histogram differs from the target distribution (chi-square p = {p:.2g})"


def _tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_tokens_follow_target_for_random_pairs(seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(8, generator=g) ** 3
    target /= target.sum()
    draft = torch.rand(8, generator=g) ** 3
    draft /= draft.sum()
    counts, rate = _run(draft, target, seed=seed)
    _assert_matches(counts, target)
    assert abs(rate - (1 - _tv(draft, target))) < 0.015


def test_identical_distributions_always_accept():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    counts, rate = _run(probs, probs)
    assert rate == 1.0
    _assert_matches(counts, probs)


def test_disjoint_supports_always_recover():
    draft = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    target = torch.tensor([0.0, 0.0, 0.2, 0.3, 0.1, 0.4])
    counts, rate = _run(draft, target)
    assert rate == 0.0
    _assert_matches(counts, target)


def test_deterministic_draft_accepts_with_target_probability():
    target = torch.tensor([0.25, 0.05, 0.6, 0.1])
    counts, rate = _run(None, target, deterministic_token=2)
    assert abs(rate - 0.6) < 0.015
    _assert_matches(counts, target)


def test_full_acceptance_emits_bonus_from_last_row():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # [k + 1, vocab]
    a, nxt = rejection_sample(torch.tensor([1, 2]), None, target, make_generator(0))
    assert (a, nxt) == (2, 0)


def test_greedy_accepts_matching_prefix_then_target_argmax():
    logits = torch.tensor([[0, 5.0, 0], [0, 0, 5.0], [5.0, 0, 0], [0, 5.0, 0]])  # argmax 1, 2, 0, 1
    assert greedy_accept(torch.tensor([1, 2, 2]), logits) == (2, 0)


def test_greedy_rejects_at_first_mismatch():
    logits = torch.tensor([[0, 5.0, 0], [0, 0, 5.0]])
    assert greedy_accept(torch.tensor([0]), logits) == (0, 1)


def test_greedy_full_acceptance_emits_bonus():
    logits = torch.tensor([[0, 5.0, 0], [0, 0, 5.0]])
    assert greedy_accept(torch.tensor([1]), logits) == (1, 2)
