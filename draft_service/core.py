"""The draft service without the wire: one draft-model proposer per session (LRU-bounded), and
concurrent Propose calls with the same sampling settings drafted together in one batch.

A session stores the committed tokens the caller last named. The proposer itself keeps its KV
cache aligned with whatever tokens it is given (it rolls back to the common prefix), so a
pipelined Propose from an optimistic prefix that turns out wrong costs nothing to undo. A
missing or stale session is refused with NotFound; the caller prefills it again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from specdec.errors import InvalidRequest
from specdec.backends.hf import CausalLM
from specdec.proposers.draft_model import DraftModelProposer, DraftRows
from specdec.service.batching import MicroBatcher
from specdec.service.metrics import ServiceMetrics
from specdec.service.session_table import SessionTable
from specdec.service.memory import IdleTrim
from specdec.service.sync import Position, check_position, synced_tokens
from specdec.sampling import draft_seed, make_generator
from specdec.sessions import PrefixDigests, check_token_ids, step_seed
from specdec.types import DraftBlock, DraftKind, ProposeContext, SamplingParams


def _draft_generator(sampling: SamplingParams, committed_len: int) -> torch.Generator:
    """A session's draft randomness at one position: from its own seed and position only, so its
    drafts (and its output) do not depend on the sessions it shares a batch with."""
    return make_generator(step_seed(draft_seed(sampling.seed), committed_len))


@dataclass(frozen=True)
class DraftSettings:
    max_sessions: int = 256  # proposers (KV caches) kept; least recently used evicted beyond this
    max_batch: int = 8
    batch_window_ms: float = 1.0
    max_k: int = 32
    max_queue: int = 256


@dataclass
class DraftSession:
    session_id: str
    rows: DraftRows  # the session's draft KV cache (batch 1) and the tokens it holds
    tokens: list[int] = field(default_factory=list)  # the committed tokens the caller last named
    digests: PrefixDigests = field(default_factory=PrefixDigests)  # of every prefix of `tokens`
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Job:
    session: DraftSession
    position: Position
    k: int
    sampling: SamplingParams
    with_guess: bool


class DraftCore:
    def __init__(self, draft: CausalLM, settings: DraftSettings = DraftSettings(),
                 metrics: Optional[ServiceMetrics] = None):
        self.draft = draft
        self.settings = settings
        self.metrics = metrics or ServiceMetrics("draft")
        self.sessions: SessionTable[DraftSession] = SessionTable(
            settings.max_sessions, lambda sid: DraftSession(sid, DraftRows.empty(draft)), self.metrics.sessions,
            on_count=IdleTrim())  # (the heap's free memory back to the system once no session is held)
        self.batcher = MicroBatcher(self._run, max_batch=settings.max_batch, window_s=settings.batch_window_ms / 1000,
                                    max_queue=settings.max_queue, metrics=self.metrics,
                                    expect_company=self.sessions.active_recently)

    def _session(self, session_id: str, create: bool = False) -> DraftSession:
        return self.sessions.get(session_id, create)

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)

    async def prefill(self, session_id: str, token_ids: Sequence[int]) -> int:
        ids = check_token_ids(token_ids, self.draft.vocab_size, "prompt token ids")
        if not ids:
            raise InvalidRequest("prefill needs at least one token")
        if len(ids) >= self.draft.max_positions:
            raise InvalidRequest(f"{len(ids)} tokens exceed the draft's context of {self.draft.max_positions}")
        sess = self._session(session_id, create=True)
        async with sess.lock:
            def work():
                # Compute the prompt's KV now (the caller overlaps this with the target's prefill).
                sess.rows.load(self.draft, ids)
                sess.tokens, sess.digests = ids, PrefixDigests(ids)
            await self.batcher.run_alone(work)
        self.metrics.session_rebuilds.inc()
        return len(ids)

    async def propose(self, session_id: str, committed_len: int, new_token_ids: Sequence[int], digest: int, k: int,
                      sampling: SamplingParams, with_guess: bool = False) -> DraftBlock:
        if not 1 <= k <= self.settings.max_k:
            raise InvalidRequest(f"k must be in [1, {self.settings.max_k}], got {k}")
        pos = check_position(Position(committed_len, tuple(new_token_ids), digest), self.draft.vocab_size, k + 1,
                             self.draft.max_positions, "draft")
        sess = self._session(session_id)
        async with sess.lock:
            return await self.batcher.submit(_Job(sess, pos, k, sampling, with_guess))

    # --- the model thread ------------------------------------------------------------------
    def _sync(self, job: _Job) -> list[int]:
        sess, pos = job.session, job.position
        sess.tokens = synced_tokens(sess.session_id, sess.tokens, sess.digests, pos)
        sess.digests.truncate(pos.base)
        sess.digests.extend(pos.new_token_ids)
        return sess.tokens

    def _run(self, jobs: Sequence[_Job]) -> list:
        results: list = [None] * len(jobs)
        groups: dict[SamplingParams, list[int]] = {}
        for i, job in enumerate(jobs):
            try:
                self._sync(job)
                groups.setdefault(job.sampling, []).append(i)
            except Exception as exc:  # noqa: BLE001 - one bad session must not fail the batch
                results[i] = exc
        for sampling, idx in groups.items():
            for i, res in zip(idx, self._propose_group([jobs[i] for i in idx], sampling)):
                results[i] = res
        return results

    def _propose_group(self, jobs: Sequence[_Job], sampling: SamplingParams) -> list[DraftBlock]:
        """Draft for several sessions in one batched forward (on a draft whose caches cannot be
        stacked, llama.cpp's: each session on its own cache, side by side, run_each)."""
        if len(jobs) > 1 and not self.draft.stacks_caches:
            return self.draft.run_each([lambda job=job: self._propose_group([job], sampling)[0] for job in jobs],
                                       [job.session.rows.cache for job in jobs])
        ks = tuple(j.k + (1 if j.with_guess else 0) for j in jobs)
        generators = None if sampling.greedy else tuple(_draft_generator(sampling, len(j.session.tokens)) for j in jobs)
        ctx = ProposeContext(row_ids=tuple(range(len(jobs))), token_ids=tuple(tuple(j.session.tokens) for j in jobs),
                             k=ks, sampling=sampling, generators=generators)
        # One session drafts on its own rows; several on their rows stacked, split back afterwards.
        rows = jobs[0].session.rows if len(jobs) == 1 else DraftRows.stack([j.session.rows for j in jobs],
                                                                           self.draft.new_cache)
        proposals = DraftModelProposer(self.draft, rows).propose(ctx)
        if len(jobs) > 1:
            for job, own in zip(jobs, rows.split(self.draft.new_cache)):
                job.session.rows = own
        kind = DraftKind.DETERMINISTIC if sampling.greedy else DraftKind.SAMPLED  # argmax, or drawn
        out = []
        for job, prop in zip(jobs, proposals):
            toks = prop.token_ids
            probs = prop.draft_probs[: job.k] if prop.draft_probs is not None else None
            out.append(DraftBlock(tuple(toks[: job.k]), probs, toks[job.k] if job.with_guess else None, kind))
        return out

    async def close(self) -> None:
        await self.batcher.close()
