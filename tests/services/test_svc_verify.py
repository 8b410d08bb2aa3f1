"""The core's batched verification step (specdec/verify.py) and KV stacking (specdec/backends/kv_stack.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.decode import plain_generate
from specdec.backends.kv_stack import split_cache, stack_caches
from specdec.sampling import make_generator
from specdec.types import Proposal, SamplingParams, StopConditions
from specdec.verify import RowStep, load_committed, verify_sessions


def _cache(lm, tokens):
    cache = lm.new_cache(1)
    load_committed(lm, cache, tokens)
    return cache


@pytest.fixture(params=["hf", "fast"])
def target(request, tiny_target):
    """The tiny target through transformers and through specdec's fast forward (whose cache
    stores slots differently): services stack either kind."""
    if request.param == "hf":
        return tiny_target
    from specdec.backends.fast import FastLlamaLM

    return FastLlamaLM(copy.deepcopy(tiny_target.model), name="fast")


def test_stacking_and_splitting_keeps_every_rows_valid_slots(target):
    caches = [_cache(target, t) for t in ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16])]
    caches.append(target.new_cache(1))  # a session with nothing cached yet
    stacked = stack_caches(caches, target.new_cache)
    assert type(stacked) is type(caches[0])
    assert stacked.batch_size == 4 and stacked.lengths.tolist() == [3, 1, 5, 0]
    for orig, back in zip(caches, split_cache(stacked, target.new_cache)):
        assert back.lengths.tolist() == orig.lengths.tolist()
        assert len(back.layer_kv()) == len(orig.layer_kv())
        for (ka, va), (kb, vb) in zip(orig.layer_kv(), back.layer_kv()):
            assert torch.equal(ka[:, :, orig.valid[0]], kb) and torch.equal(va[:, :, orig.valid[0]], vb)


def test_batched_verify_step_equals_one_session_at_a_time_and_plain_decoding(target):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    plain = [plain_generate(target, [p], stop=StopConditions(max_new_tokens=4))[0].token_ids for p in prompts]
    # Draft the plain continuation with one wrong token in the middle: accept 2, then recover.
    drafts = [(w[0], w[1], (w[2] + 1) % 96, w[3]) for w in plain]

    def step(batched):
        caches = [_cache(target, p) for p in prompts]
        rows = [RowStep(p[-1], Proposal(token_ids=d), SamplingParams(), make_generator(0))
                for p, d in zip(prompts, drafts)]
        if batched:
            outs, caches = verify_sessions(target, caches, rows)
        else:
            done = [verify_sessions(target, [c], [r]) for c, r in zip(caches, rows)]
            outs, caches = [o for (o,), _ in done], [c for _, (c,) in done]
        return [o.verdict.emitted for o in outs], [c.lengths.tolist() for c in caches]

    batched, lens_b = step(True)
    single, lens_s = step(False)
    assert batched == single == [tuple(w[:3]) for w in plain]
    assert lens_b == lens_s == [[len(p) + 2] for p in prompts]  # root + 2 accepted kept in each cache

