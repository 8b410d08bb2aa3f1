"""One verification step for independent sessions, batched into one target forward pass.

This is the body of speculative_generate's loop (score, accept, commit / roll back) for callers
that keep one KV cache per session and bring the sessions together only for the forward pass,
as the target service does. It reuses the loop's own block builder and acceptance rule, so a
session verified here gets exactly the tokens the in-process loop would give it.

Invariant of a session's cache: it holds the KV of every committed token except the last one,
which is fed again as the *root* of the next block (the first block's root is the last prompt
token, so prefilling a prompt and rebuilding a session from its committed tokens are the same
operation: `load_committed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdec.decode import accept_block, verify_block
from specdec.kv_cache import KVCache
from specdec.kv_stack import split_cache, stack_caches
from specdec.lm import CausalLM
from specdec.types import Proposal, SamplingParams, Verdict


@dataclass(frozen=True)
class VerifyJob:
    """One session's step: its cache (holding committed[:-1]) is updated in place."""

    cache: KVCache  # batch 1
    root: int  # the last committed token
    proposal: Proposal
    sampling: SamplingParams
    generator: torch.Generator
    want_hidden: bool = False
    # The row id the proposal was made under (ProposeContext.row_ids); the Verdict carries it
    # back, since a proposer's observe() finds its per-row state by that id, not by batch slot.
    row_id: int = 0


@dataclass(frozen=True)
class StepOutcome:
    verdict: Verdict  # row_id is the job's row_id
    hidden: Optional[torch.Tensor] = None  # [hidden] target state that produced the last emitted token


def load_committed(target: CausalLM, cache: KVCache, committed: Sequence[int]) -> None:
    """Make a batch-1 cache hold committed[:-1], keeping whatever prefix it already holds correctly.

    The cache's valid tokens must be a prefix of `committed` (callers truncate it first)."""
    have = int(cache.lengths[0])
    want = len(committed) - 1
    if have > want:
        cache.truncate(torch.tensor([want]))
    elif have < want:
        target.prefill(cache, [list(committed[have:want])])


def _pack(blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = max(len(ids) for ids, _, _ in blocks)
    ids = torch.zeros(len(blocks), q, dtype=torch.long)  # [rows, q]
    mask = torch.zeros(len(blocks), q, q, dtype=torch.bool)  # [rows, q, q]
    depth = torch.zeros(len(blocks), q, dtype=torch.long)  # [rows, q]
    valid = torch.zeros(len(blocks), q, dtype=torch.bool)  # [rows, q]
    for i, (row_ids, row_mask, row_depth) in enumerate(blocks):
        n = len(row_ids)
        ids[i, :n] = torch.tensor(row_ids)
        mask[i, :n, :n] = row_mask
        depth[i, :n] = row_depth
        valid[i, :n] = True
    return ids, mask, depth, valid


def verify_step(target: CausalLM, jobs: Sequence[VerifyJob]) -> list[StepOutcome]:
    """Score every job's [root] + drafted nodes (+ aux inputs) in one forward, accept, and keep
    the root and the accepted path in each job's cache."""
    if not jobs:
        return []
    single = len(jobs) == 1
    cache = jobs[0].cache if single else stack_caches([j.cache for j in jobs], target.new_cache)
    want_hidden = any(j.want_hidden for j in jobs)
    blocks = [verify_block(j.proposal, j.root) for j in jobs]
    ids, mask, depth, valid = _pack(blocks)
    out = target.forward(cache, ids, mask, depth, valid, want_hidden=want_hidden)
    logits = out.logits  # [rows, q, vocab]
    keep = torch.zeros_like(valid)  # [rows, q]
    outcomes = []
    for i, job in enumerate(jobs):
        prop = job.proposal
        n = len(prop.token_ids)
        path, nxt = accept_block(prop, logits[i, : n + 1], job.sampling, job.generator)
        keep[i, 0] = True
        keep[i, [p + 1 for p in path]] = True
        m = len(prop.aux.token_ids) if prop.aux is not None else 0
        verdict = Verdict(row_id=job.row_id, num_drafted=n, num_accepted=len(path),
                          emitted=tuple(prop.token_ids[p] for p in path) + (nxt,),
                          aux_logits=logits[i, n + 1 : n + 1 + m] if m else None)
        hidden = out.hidden[i, path[-1] + 1 if path else 0] if job.want_hidden else None
        outcomes.append(StepOutcome(verdict, hidden))
    cache.keep_last(keep)
    if not single:
        for job, row in zip(jobs, split_cache(cache, target.new_cache)):
            job.cache.hf, job.cache.valid = row.hf, row.valid
    return outcomes
