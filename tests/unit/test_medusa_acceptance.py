"""Acceptance along trees on tiny vocabularies: lossless sampling over a tree of deterministic
drafts emits exactly the target's distribution; typical acceptance (lossy) follows its rule."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.acceptance import tree_rejection_sample, typical_accept
from specdec.sampling import make_generator

VOCAB = 6


def _probs(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(VOCAB, generator=g) ** 2
    return p / p.sum()


def test_tree_sampling_first_two_tokens_follow_the_target():
    # root -> {2, 4}; node 0 (token 2) -> {1}; target distributions per block index.
    token_ids, parents = (2, 4, 1), (-1, -1, 0)
    target = torch.stack([_probs(s) for s in range(4)])  # [n + 1, vocab]
    gen = make_generator(0)
    counts = np.zeros((VOCAB, VOCAB))
    n = 20_000
    accepted = 0
    for _ in range(n):
        path, nxt = tree_rejection_sample(token_ids, parents, target, gen)
        emitted = [token_ids[i] for i in path] + [nxt]
        accepted += len(path)
        if len(emitted) >= 2:
            counts[emitted[0], emitted[1]] += 1
    # Joint of the first two tokens whenever two were emitted: token a at the root, then b at
    # node(a). Two tokens are emitted exactly when a is a root child: a = 2 (node 0) or 4 (node 1).
    next_dist = {2: target[1], 4: target[2]}
    want = np.zeros((VOCAB, VOCAB))
    for a, dist in next_dist.items():
        want[a] = float(target[0, a]) * dist.double().numpy()
    mask = want > 0
    assert counts[~mask].sum() == 0
    p = chisquare(counts[mask], want[mask] / want[mask].sum() * counts[mask].sum()).pvalue
    assert p > 0.001, f"two-token histogram differs from the target (p = {p:.2g})"
    # Acceptance at the root is P(2) + P(4) (both children are tried), then P(1) under token 2.
    want_accepted = float(target[0, 2] + target[0, 4] + target[0, 2] * target[1, 1])
    assert abs(accepted / n - want_accepted) < 0.02


def test_tree_sampling_first_token_follows_the_target():
    token_ids, parents = (0, 3), (-1, -1)
    target = torch.stack([_probs(s) for s in range(10, 13)])
    gen = make_generator(1)
    counts = np.zeros(VOCAB)
    for _ in range(20_000):
        path, nxt = tree_rejection_sample(token_ids, parents, target, gen)
        counts[token_ids[path[0]] if path else nxt] += 1
    p = chisquare(counts, target[0].double().numpy() * counts.sum()).pvalue
    assert p > 0.001


def _typical_threshold(p, eps, alpha):
    entropy = float(-(p * p.log()).sum())
    return min(eps, alpha * np.exp(-entropy))


def test_typical_accepts_tokens_above_threshold_and_stops_at_the_first_atypical():
    sharp = torch.tensor([0.85, 0.05, 0.04, 0.03, 0.02, 0.01])
    # chain 0 -> 1 -> 5: token 0 typical at the root, token 1 typical? 0.05 vs threshold.
    thr = _typical_threshold(sharp, 0.09, 0.3)
    assert 0.05 < thr < 0.85  # so token 0 passes and token 1 fails
    target = torch.stack([sharp, sharp, sharp, sharp])
    path, nxt = typical_accept((0, 1, 5), (-1, 0, 1), target, make_generator(0))
    assert path == [0]
    assert nxt == 0  # only token 0 is typical after it


def test_typical_accepts_the_deepest_typical_branch():
    flat = torch.full((VOCAB,), 1.0 / VOCAB)  # entropy log 6: threshold min(.09, .3/6 = .05) = .05
    target = torch.stack([flat] * 5)
    # root -> a (tok 1) ; root -> b (tok 2) -> c (tok 3) -> d (tok 4): every token has 1/6 > .05
    path, _ = typical_accept((1, 2, 3, 4), (-1, -1, 1, 2), target, make_generator(0))
    assert path == [1, 2, 3]


def test_typical_rejects_everything_when_the_target_is_sure_of_another_token():
    sure = torch.tensor([0.001, 0.995, 0.001, 0.001, 0.001, 0.001])
    target = torch.stack([sure, sure, sure])
    for seed in range(20):
        path, nxt = typical_accept((0, 2), (-1, -1), target, make_generator(seed))
        assert path == [] and nxt == 1


def test_typical_next_token_is_drawn_from_typical_tokens_only():
    p = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.006, 0.004])
    thr = _typical_threshold(p, 0.09, 0.3)
    gen = make_generator(3)
    seen = {typical_accept((), (), p[None], gen)[1] for _ in range(400)}
    assert seen == {i for i in range(VOCAB) if float(p[i]) > thr}
