"""With sampling, speculative decoding draws from exactly the target's distribution: the first
two emitted tokens are compared with the model's own joint probabilities."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.decode import plain_generate, speculative_generate
from specdec.testing import perturbed_copy, tiny_llama
from specdec.proposers import DraftModelProposer, PromptLookupProposer
from specdec.types import SamplingParams, StopConditions
from tests.conftest import full_logits, gguf_copy

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2]
ROWS = 1500  # rows of one batch are independent samples (row b is seeded with seed + b)


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_llama(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=32, eos_token_id=VOCAB + 10)


def _joint_probs(lm, sampling):
    from specdec.sampling import logits_to_probs

    first = logits_to_probs(full_logits(lm, PROMPT)[-1], sampling)
    joint = torch.zeros(VOCAB, VOCAB)
    for a in range(VOCAB):
        joint[a] = first[a] * logits_to_probs(full_logits(lm, PROMPT + [a])[-1], sampling)
    return joint.double().flatten().numpy()


def _histogram(results):
    counts = np.zeros(VOCAB * VOCAB)
    for r in results:
        counts[r.token_ids[0] * VOCAB + r.token_ids[1]] += 1
    return counts


def _assert_fits(counts, probs):
    assert counts[probs == 0].sum() == 0, "emitted a sequence the target gives probability 0"
    keep = probs * counts.sum() >= 5  # rare outcomes are pooled into one bin
    expected, observed = probs[keep] * counts.sum(), counts[keep]
    if probs[~keep].sum() > 0:
        expected = np.append(expected, probs[~keep].sum() * counts.sum())
        observed = np.append(observed, counts[~keep].sum())
    p = chisquare(observed, expected / expected.sum() * observed.sum()).pvalue
    assert p > 0.001, f"first-two-token histogram differs from the target's (p = {p:.2g})"


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=11),
                                      SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=12)])
@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_speculative_sampling_matches_target_distribution(small_vocab_target, sampling, name):
    lm = small_vocab_target
    proposer = DraftModelProposer(perturbed_copy(lm, 0.5, seed=2)) if name == "draft_model" else PromptLookupProposer()
    results = speculative_generate(lm, proposer, [PROMPT] * ROWS, sampling=sampling,
                                   stop=StopConditions(max_new_tokens=3), k=3)
    assert sum(r.stats.accepted for r in results) > 0, "the draft never got accepted: the test checks nothing"
    _assert_fits(_histogram(results), _joint_probs(lm, sampling))


def test_plain_sampling_matches_target_distribution(small_vocab_target):
    sampling = SamplingParams(temperature=1.0, seed=5)
    results = plain_generate(small_vocab_target, [PROMPT] * ROWS, sampling=sampling, stop=StopConditions(max_new_tokens=2))
    _assert_fits(_histogram(results), _joint_probs(small_vocab_target, sampling))


def test_seeded_speculative_sampling_is_reproducible(tiny_target, tiny_draft):
    sampling = SamplingParams(temperature=0.9, seed=42)
    runs = [speculative_generate(tiny_target, DraftModelProposer(tiny_draft), [[4, 5, 6]], sampling=sampling,
                                 stop=StopConditions(max_new_tokens=24), k=4)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_seeded_row_does_not_depend_on_its_batch_neighbours(tiny_target, tiny_draft):
    sampling = SamplingParams(temperature=0.9, seed=42)

    def first_row(prompts):
        return speculative_generate(tiny_target, DraftModelProposer(tiny_draft), prompts, sampling=sampling,
                                    stop=StopConditions(max_new_tokens=24), k=4)[0].token_ids

    alone = first_row([[4, 5, 6]])
    assert first_row([[4, 5, 6], [7, 8, 9, 10]]) == alone
    assert first_row([[4, 5, 6], [11, 3], [50, 51, 52, 53, 54]]) == alone


@pytest.mark.parametrize("name", ["draft_model", "prompt_lookup"])
def test_speculative_sampling_on_llamacpp_matches_its_own_distribution(small_vocab_target, tmp_path, name):
    """The same on the llama.cpp backend (the target written as a GGUF): emitted pairs follow the
    probabilities llama.cpp itself computes. Rows in batches of 250 (llama.cpp's sequence limit)."""
    lm = gguf_copy(small_vocab_target, tmp_path / "small.gguf", context=16)
    sampling = SamplingParams(temperature=1.0)
    proposer = (lambda: DraftModelProposer(perturbed_copy(small_vocab_target, 0.5, seed=2))) if name == "draft_model" \
        else PromptLookupProposer
    results = []
    for chunk in range(ROWS // 250):
        seeded = SamplingParams(temperature=1.0, seed=1000 * chunk + 7)
        results += speculative_generate(lm, proposer(), [PROMPT] * 250, sampling=seeded,
                                        stop=StopConditions(max_new_tokens=3, eos_token_ids=()), k=3)
    assert sum(r.stats.accepted for r in results) > 0, "the draft never got accepted: the test checks nothing"
    _assert_fits(_histogram(results), _joint_probs(lm, sampling))
