"""The core's batched verification step (specdec/verify.py) and KV stacking (specdec/kv_stack.py)."""

from __future__ import annotations

import torch

from specdec.decode import plain_generate
from specdec.kv_stack import split_cache, stack_caches
from specdec.sampling import make_generator
from specdec.types import Proposal, SamplingParams, StopConditions
from specdec.verify import VerifyJob, load_committed, verify_step


def _cache(lm, tokens):
    cache = lm.new_cache(1)
    load_committed(lm, cache, tokens)
    return cache


def test_stacking_and_splitting_keeps_every_rows_valid_slots(tiny_target):
    caches = [_cache(tiny_target, t) for t in ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16])]
    stacked = stack_caches(caches, tiny_target.new_cache)
    assert stacked.batch_size == 3 and stacked.lengths.tolist() == [3, 1, 5]
    for orig, back in zip(caches, split_cache(stacked, tiny_target.new_cache)):
        assert back.lengths.tolist() == orig.lengths.tolist()
        for a, b in zip(orig.hf.layers, back.hf.layers):
            assert torch.equal(a.keys[:, :, orig.valid[0]], b.keys) and torch.equal(a.values[:, :, orig.valid[0]],
                                                                                     b.values)


def test_batched_verify_step_equals_one_session_at_a_time_and_plain_decoding(tiny_target):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    plain = [plain_generate(tiny_target, [p], stop=StopConditions(max_new_tokens=4))[0].token_ids for p in prompts]
    # Draft the plain continuation with one wrong token in the middle: accept 2, then recover.
    drafts = [(w[0], w[1], (w[2] + 1) % 96, w[3]) for w in plain]

    def step(batched):
        caches = [_cache(tiny_target, p) for p in prompts]
        jobs = [VerifyJob(c, p[-1], Proposal(token_ids=d), SamplingParams(), make_generator(0))
                for c, p, d in zip(caches, prompts, drafts)]
        outs = verify_step(tiny_target, jobs) if batched else [verify_step(tiny_target, [j])[0] for j in jobs]
        return [o.verdict.emitted for o in outs], [c.lengths.tolist() for c in caches]

    batched, lens_b = step(True)
    single, lens_s = step(False)
    assert batched == single == [tuple(w[:3]) for w in plain]
    assert lens_b == lens_s == [[len(p) + 2] for p in prompts]  # root + 2 accepted kept in each cache
