"""Conversion between the wire's messages and specdec's dataclasses round-trips exactly."""

import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.rpc import convert
from specdec.types import SamplingParams


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
