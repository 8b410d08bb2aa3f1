import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.sampling import logits_to_probs, make_generator, next_token
from specdec.types import SamplingParams


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, (logits / 2.0).softmax(-1))


def test_top_k_keeps_only_k_largest():
    probs = logits_to_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[[0, 3]] == 0).all()
    assert torch.allclose(probs[[1, 2]], torch.tensor([4.0, 3.0]).softmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = logits_to_probs(base.log(), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_p_always_keeps_the_top_token():
    probs = logits_to_probs(torch.tensor([5.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0]))


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(50)
    params = SamplingParams(temperature=1.0, seed=7)
    a = [next_token(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    b = [next_token(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    assert a == b


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_invalid_sampling_params_are_refused(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)
