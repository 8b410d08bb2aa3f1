"""One session's generation loop: propose (draft service), verify (target service), commit to
Redis, tell the streams; target-side Decode when the draft is out; pipelining.

Method auto takes each step the way that has cost less per emitted token so far, drafting or the
target alone (Decode "auto": plain or prompt lookup, as the target's own costs decide), measured
end to end (specdec.step_choice); a seeded sampled session always the target alone (the way a
step is taken decides which random draws it makes: moving it by measurements would break its
reproducibility). Method draft always drafts.

Order of a drafted step (draft available):
1. Propose block i on the session's draft replica (or take the block drafted ahead, if it was
   drafted from exactly the tokens now committed: a pipeline hit).
2. With pipelining on, start drafting block i+1 from the optimistic prefix (committed + block i
   + the draft's guess of the bonus token) while
3. the session's target replica verifies block i.
4. Commit the emitted tokens to Redis (versioned compare-and-set), then wake the streams. The
   write runs while the next block is drafted and verified (the step loop works on the verified
   tokens, the streams read only the committed ones, and a write must land before the next one
   starts), so a Redis round trip costs a step nothing; a failed write ends the run one step later.
When the draft fails (down, deadline missed, refused), its replica leaves the ring for a
cool-down (the circuit breaker) and the step runs on the target alone (Decode); drafting
resumes once a draft replica answers SERVING again. Greedy output is the target's own either way.

Every call carries the committed length and digest; the `*_known` lists track what each replica
is sure to hold so only new tokens travel. While a call is in flight only the part common to
before and after is sure, so that is what is kept if the call is cancelled or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional, Protocol

from specdec.errors import NotFound, Overloaded, RemoteError, SpecdecError, Unavailable
from specdec.sessions import PrefixDigests, extend_digest
from specdec.step_choice import DRAFT, LOCAL, StepRates, judged_tokens
from specdec.stopping import StopChecker
from specdec.types import DraftBlock, GenerationStats, SamplingParams, StopConditions
from specdec.verify import common_prefix_len
from coordinator.affinity import PrefixAffinity
from coordinator.slots import SessionSlots
from coordinator.records import SessionRecord

if TYPE_CHECKING:
    from specdec.rpc.clients import DraftClient, TargetClient
    from specdec.service.metrics import ServiceMetrics
    from coordinator.routing import ReplicaPool
    from coordinator.sessions import SessionStore
    from coordinator.settings import CoordinatorSettings

log = logging.getLogger("coordinator")
DRAFT_METHODS = ("auto", "draft")  # methods that draft on the draft service when it is available


class RunHost(Protocol):
    """What a run uses of the coordinator that owns it (coordinator.core.Coordinator, which imports
    this module: the run knows its host by this protocol, so the two modules form no circle)."""

    store: SessionStore
    draft_pool: ReplicaPool
    target_pool: ReplicaPool
    settings: CoordinatorSettings
    metrics: ServiceMetrics
    background: set[asyncio.Task]  # fire-and-forget calls the host awaits on close
    step_rates: StepRates  # what each way of taking a step has cost per token (auto's choice)
    affinity: PrefixAffinity  # which target replica read which prefixes
    slots: SessionSlots  # how many sessions generate at once

    def target_load(self, address: str) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def drafting_cannot_pay(self) -> bool: ...

    def draft_hopeless(self, rep) -> bool: ...

    def draft_k(self, rep) -> int: ...

    def draft_step_seen(self, rep, k: int, propose_s: float, verify_s: float) -> None: ...

    async def draft_fits(self, rep) -> bool: ...

    def run_ended(self, run: SessionRun) -> None: ...


class DraftOut(Exception):
    """The draft could not serve this step: run it on the target alone."""


def replica_fault(exc: BaseException) -> bool:
    """Whether a failed call says something about the replica (down, too slow, overloaded, broken),
    rather than about the one session's request (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND,
    ABORTED). Only the former opens the breaker: one session's bad request must not take the
    replica away from every session."""
    return isinstance(exc, (Unavailable, RemoteError, Overloaded))


@dataclass
class RunStats(GenerationStats):
    """The core's per-sequence counters (tau, alpha, tokens/s derived there) plus the service's own."""

    fallback_steps: int = 0
    pipeline_hits: int = 0
    pipeline_misses: int = 0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class _Pending:
    assumed: tuple[int, ...]  # the optimistic committed tokens it was drafted from
    address: str
    task: asyncio.Task


@dataclass
class SessionRun:
    coord: RunHost
    rec: SessionRecord
    sampling: SamplingParams
    stop: StopConditions
    method: str
    k: int  # drafted tokens a step, as the client asked (0: the cost model's, Coordinator.draft_k)
    checker: StopChecker
    stats: RunStats = field(default_factory=RunStats)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: Optional[asyncio.Task] = None
    error: Optional[BaseException] = None
    consumers: int = 0
    draft_addr: Optional[str] = None
    draft_known: list[int] = field(default_factory=list)
    target_addr: Optional[str] = None
    target_known: list[int] = field(default_factory=list)
    target_home: Optional[str] = None  # the target replica chosen at start (prefix affinity or the ring)
    pending: Optional[_Pending] = None
    last_fully_accepted: bool = False  # the last verified block was accepted whole
    draft_refused: bool = False  # the draft refused this session's request: the target continues it alone
    _step_k: int = 0  # tokens the current draft step drafts (the client's k, or the cost model's)
    _local_steps: int = 0  # Decode calls of this run on the target alone (their chunks grow: _local_chunk)
    streamed: bool = True  # someone may stream it (False: only unary requests have asked for it so far)
    _commit: Optional[asyncio.Future] = None  # the Redis write in flight
    created: Optional[asyncio.Future] = None  # the session's first write, in flight beside the first step (or None)
    tokens: list[int] = field(default_factory=list)  # verified tokens: the committed ones + the write in flight
    digests: PrefixDigests = field(default_factory=PrefixDigests)  # of `tokens`, which only grows
    # per draft model: its drafted tokens the target judged, and accepted (the host keeps them at the end)
    draft_judged: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens = list(self.rec.tokens)
        self.digests = PrefixDigests(self.tokens)

    @property
    def session_id(self) -> str:
        return self.rec.session_id

    @property
    def _seeded(self) -> bool:
        """Sampled with a seed: reproducible only if every run takes its steps the same way."""
        return not self.sampling.greedy and self.sampling.seed is not None

    @property
    def verified_all(self) -> bool:
        """No more steps to take (what the step loop asks; the streams ask `finished`)."""
        return self.checker.finish_reason is not None

    @property
    def finished(self) -> bool:
        """Finished, and every verified token committed to Redis."""
        return self.verified_all and len(self.rec.tokens) == len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.rec.generated

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"session-{self.session_id}")

    # --- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        coord = self.coord
        try:
            async with contextlib.AsyncExitStack() as slot:
                if not self.verified_all:
                    await slot.enter_async_context(coord.slots.hold())  # (waits while the targets are full)
                    t_prefill = time.perf_counter()
                    await self._prefill_both()
                    self._timed("prefill", t_prefill)
                await self._steps(time.perf_counter() - self.stats.elapsed_s)
        except asyncio.CancelledError:
            await self._pause()
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the streams, which map it to a status
            if not isinstance(exc, SpecdecError):
                log.exception("session %s failed", self.session_id)
            self.error = exc
            await self._pause()
        finally:
            self._drop_pending()
            for pool in (coord.draft_pool, coord.target_pool):  # the session's step streams, wherever they are
                for rep in pool.replicas.values():
                    rep.client.end_session(self.session_id)
            coord.run_ended(self)
            async with self.changed:
                self.changed.notify_all()

    async def _steps(self, t0: float) -> None:
        """Step until every token is verified, committing each step's tokens behind the next one."""
        coord = self.coord
        while not self.verified_all:
            t_step = time.perf_counter()
            emitted = await self._step()
            t_wait = time.perf_counter()
            await self._committed()  # the previous step's write (it raises what that write raised)
            self._timed("commit wait", t_wait)
            taken = self.checker.push(emitted)
            self.tokens.extend(taken)
            self.digests.extend(taken)
            self.stats.emitted += len(taken)
            self.stats.elapsed_s = time.perf_counter() - t0
            status = "done" if self.verified_all else "running"
            if self.verified_all:  # the target keeps the session's KV (prefix cache) for the next turn
                self._release_target()
            # 4. commit before anyone sees the tokens; a cancellation does not cut a write in half.
            self._commit = asyncio.ensure_future(self._commit_and_tell(
                taken, status, self.checker.finish_reason or "", self.stats.to_dict()))
            if not coord.settings.commit_behind:
                t_wait = time.perf_counter()
                await self._committed()
                self._timed("commit wait", t_wait)
            self._timed("step", t_step)
        await self._committed()
        self._release_caches()

    async def _committed(self) -> None:
        if self._commit is not None:
            await asyncio.shield(self._commit)

    async def _commit_and_tell(self, taken: list[int], status: str, finish_reason: str, stats: dict) -> None:
        """Write a step's tokens to Redis, then wake the streams (which read only what is written)."""
        t0 = time.perf_counter()
        await self._created()
        await self.coord.store.commit(self.rec, taken, status, finish_reason, stats)
        t_notify = self._timed("commit", t0)
        self.coord.metrics.generated_tokens.inc(len(taken))
        async with self.changed:
            self.changed.notify_all()
        self._timed("notify", t_notify)

    async def _created(self) -> None:
        """The session's record is in Redis (Coordinator._open may write it beside the first step)."""
        if self.created is not None:
            if not await self.created:
                raise Unavailable(f"session {self.session_id} could not be stored: its id exists already")
            self.created = None

    async def _pause(self) -> None:
        """Leave the session resumable: status paused (shielded from the cancellation itself)."""
        try:
            await self._committed()  # let a write in flight land first (or say how it failed)
            if self.finished:
                return
            await asyncio.shield(self._created())
            await asyncio.shield(self.coord.store.commit(self.rec, [], "paused", "", self.stats.to_dict()))
        except (SpecdecError, asyncio.CancelledError):
            pass

    def _timed(self, phase: str, since: float) -> float:
        """Record a phase of the step timeline (coordinator metrics) -> now."""
        now = time.perf_counter()
        self.coord.metrics.step_phase.labels(phase=phase).observe(now - since)
        return now

    async def _step(self) -> tuple[int, ...]:
        remaining = self.checker.remaining
        if self.method in DRAFT_METHODS:
            draft = None if self.draft_refused else self.coord.draft_pool.pick(self.session_id)
            # the client's k, or the cost model's for this draft (a seeded sampled session keeps default_k: its
            # random draws depend on where the blocks fall, and the cost model's k moves with what it measures)
            want = self.k or (self.coord.settings.default_k if self._seeded else self.coord.draft_k(draft))
            k = min(want, remaining - 1)
            if k < 1:  # one token left: a plain step, no draft needed (a unary Decode: a request for one token
                # opened a step stream for it otherwise, 6 ms of a 30 ms request measured through specdec up)
                return await self._decode("", 1, fallback=False)
            rates = self.coord.step_rates
            # auto: drafting or the target alone, whichever has cost less per token (specdec.step_choice);
            # a seeded sampled session always the target alone: its random draws depend on the way
            # (not before a streamed session's first token, whose latency the client sees)
            # and never the draft where the target says none could pay (k tokens a forward cost k steps): not even to measure it,
            # nor, but rarely, a draft whose measured acceptance could not pay on this target were it free
            way = (DRAFT if self.method == "draft" else LOCAL if self._seeded or self.coord.drafting_cannot_pay
                   else rates.choose(draft is not None, may_explore=bool(self.generated) or not self.streamed,
                                     draft_hopeless=draft is not None and self.coord.draft_hopeless(draft)))
            # a step whose call loads the session into the target (its first: _prefill_both) says nothing of a step's cost
            loads_target = not self.target_known
            t = time.perf_counter()
            if way == LOCAL:
                chunk = self._local_chunk()
                emitted = await self._decode("auto", min(remaining, chunk), fallback=draft is None)
                if draft is not None and chunk == self._full_chunk() and not loads_target:  # (nor short first chunks)
                    rates.record(LOCAL, time.perf_counter() - t, len(emitted))
                elif draft is not None:
                    rates.skipped(LOCAL, time.perf_counter() - t)
                return emitted
            if draft is not None:
                emitted = await self._draft_step(draft, k, typical=k == want and not loads_target)
                if emitted is not None:
                    return emitted
            return await self._decode("", min(remaining, self.coord.settings.fallback_chunk), fallback=True)
        return await self._decode("" if self.method == "target" else self.method, min(remaining, self._local_chunk()),
                                  fallback=False)

    async def _draft_step(self, draft, k: int, typical: bool) -> Optional[tuple[int, ...]]:
        """Draft k tokens on `draft` and verify them -> the emitted tokens (None: the draft is out).
        What it measured goes to the host: the judged and accepted tokens (kept at the run's end),
        the draft's cost c (a Propose's seconds against the Verify's), and, for auto, the step's
        seconds a token, unless it was not typical (it loaded the draft or the target, or the answer's
        end cut k)."""
        rates = self.coord.step_rates
        warm = draft.address == self.draft_addr
        hits = self.stats.pipeline_hits
        self._step_k = k
        t = time.perf_counter()
        try:
            block = await self._propose(draft, k)
        except DraftOut:
            return None
        t_verify = self._timed("propose", t)
        verdict = await self._verify(block)
        done = self._timed("verify", t_verify)
        counts = self.draft_judged.setdefault(draft.model, [0, 0])
        counts[0] += judged_tokens(verdict.num_drafted, verdict.num_accepted)
        counts[1] += verdict.num_accepted
        if warm and typical:
            rates.record(DRAFT, done - t, len(verdict.emitted))
            if self.stats.pipeline_hits == hits:  # (a block drafted ahead cost this step no Propose)
                self.coord.draft_step_seen(draft, k, t_verify - t, done - t_verify)
        else:
            rates.skipped(DRAFT, done - t)
        return verdict.emitted

    def _local_chunk(self) -> int:
        """Tokens for the next Decode on the target alone: 1, 2, 4, ... up to decode_chunk, so the
        first token streams as soon as it exists and later ones travel in few round trips; never
        fewer than the tokens generated so far (a session that drafted first takes whole chunks).
        A session no one streams, without stop strings (which only the coordinator checks), takes
        unary_chunk tokens a Decode from the start: nobody sees a token before the last."""
        if self._unary_chunks:
            return self.coord.settings.unary_chunk
        self._local_steps += 1
        return min(self.coord.settings.decode_chunk, max(1 << (self._local_steps - 1), len(self.generated)))

    @property
    def _unary_chunks(self) -> bool:
        return not self.streamed and not self.stop.stop_strings

    def _full_chunk(self) -> int:
        """The most tokens one Decode on the target alone takes for this session."""
        return self.coord.settings.unary_chunk if self._unary_chunks else self.coord.settings.decode_chunk

    def _release_target(self) -> None:
        """Release the finished session on its target replica as its answer goes out (the target
        keeps its KV for a conversation's next turn: Coordinator.release_behind)."""
        rep = self.coord.target_pool.replicas.get(self.target_addr) if self.target_addr else None
        self.target_addr = None  # (_release_caches leaves it alone)
        if rep is not None:
            self.coord.affinity.remember(self.tokens, rep.address)  # what its prefix cache now holds
            self.coord.release_behind(rep, self.session_id)

    def _release_caches(self) -> None:
        """A finished session's KV caches are freed at once (best effort; LRU eviction is the backstop)."""
        async def release(pool, address) -> None:
            rep = pool.replicas.get(address) if address else None
            if rep is not None:
                try:
                    await rep.client.release(self.session_id)
                except SpecdecError:
                    pass

        loop = asyncio.get_running_loop()
        for pool, address in ((self.coord.draft_pool, self.draft_addr), (self.coord.target_pool, self.target_addr)):
            task = loop.create_task(release(pool, address))
            self.coord.background.add(task)
            task.add_done_callback(self.coord.background.discard)

    async def _prefill_both(self) -> None:
        """Load the session into its draft and target replicas at once (two processes, in parallel);
        a session that runs on the target alone is loaded by its first step's call instead (which
        names every committed token: one round trip less). A failure here is not fatal: the first
        step prefills (or falls back) again."""
        committed = list(self.tokens)

        async def draft(rep) -> None:
            try:
                if not await self.coord.draft_fits(rep):
                    return
                await rep.client.prefill(self.session_id, committed)
                self.draft_addr, self.draft_known = rep.address, committed
            except SpecdecError as exc:
                self._draft_failed(rep, exc)

        async def fits(rep) -> None:
            try:
                await self.coord.draft_fits(rep)
            except SpecdecError as exc:
                self._draft_failed(rep, exc)

        async def target(rep, beside: bool) -> None:
            if not beside:  # nothing loads beside it: the first step's call carries the prompt (one round trip less)
                self.target_addr, self.target_known = rep.address, []
                self.coord.affinity.remember(committed, rep.address)
                return
            try:
                await self.coord.releases_landed(rep.address)  # (what they keep, this prefill may reuse)
                await rep.client.prefill(self.session_id, committed)
                self.target_addr, self.target_known = rep.address, committed
                self.coord.affinity.remember(committed, rep.address)
            except SpecdecError as exc:
                if replica_fault(exc):
                    self.coord.target_pool.mark_failed(rep.address, str(exc))

        async with asyncio.TaskGroup() as tg:
            # auto loads the draft beside the target only once drafting measured faster (else a step loads it)
            wanted = self.method == "draft" or (self.method in DRAFT_METHODS and not self._seeded
                                                and self.coord.step_rates.wants_draft())
            drafter = self.coord.draft_pool.pick(self.session_id) if self.method in DRAFT_METHODS else None
            if drafter is not None:
                tg.create_task(draft(drafter) if wanted else fits(drafter))  # (a misfit is refused at once either way)
            # The target's first step call loads it where nothing loads beside it and auto does not need that
            # step's cost (it weighs drafting against the target alone by their steps' seconds a token)
            local = (drafter is None or self._seeded or self.coord.drafting_cannot_pay
                     or (self.method == "auto" and self.coord.draft_hopeless(drafter)
                         and self.coord.step_rates.faster() != DRAFT))
            if (rep := self._pick_target()) is not None:
                tg.create_task(target(rep, beside=not local))

    # --- draft -----------------------------------------------------------------------------
    def _drop_pending(self) -> None:
        if self.pending is not None:
            self.pending.task.cancel()
            self.pending = None

    async def _send_propose(self, rep, tokens: list[int], digest: int, k: int, with_guess: bool) -> DraftBlock:
        """digest: token_digest(tokens)."""
        client: DraftClient = rep.client
        if rep.address != self.draft_addr:
            if not await self.coord.draft_fits(rep):
                raise DraftOut()
            self.draft_addr, self.draft_known = None, []
            await client.prefill(self.session_id, tokens)
            self.draft_addr, self.draft_known = rep.address, list(tokens)
        known = common_prefix_len(self.draft_known, tokens)
        self.draft_known = self.draft_known[:known]  # only this much is sure while the call is in flight
        block = await client.propose(self.session_id, tokens, known, k, self.sampling, with_guess=with_guess,
                                     vocab_size=self.coord.vocab_size,
                                     timeout=self.coord.settings.propose_deadline_s, digest=digest)
        if rep.address == self.draft_addr:
            self.draft_known = list(tokens)
        return block

    def _draft_failed(self, rep, exc: SpecdecError) -> None:
        """A replica fault opens the draft's breaker for everyone; a refusal of this session's
        request only moves this session to the target."""
        self.draft_addr = None
        if replica_fault(exc):
            self.coord.draft_pool.mark_failed(rep.address, str(exc))
        else:
            log.info("session %s continues on the target alone: the draft refused it (%s)", self.session_id, exc)
            self.draft_refused = True

    async def _propose(self, rep, k: int) -> DraftBlock:
        committed, digest = list(self.tokens), self.digests.last()
        # Drafting ahead pays only when the whole block and the guessed bonus are accepted (about
        # alpha^(k+1)); try it after a fully accepted block, not after a rejection.
        pipeline = self.coord.settings.pipeline and self.last_fully_accepted
        block = None
        if self.pending is not None:
            p, self.pending = self.pending, None
            if p.assumed == tuple(committed) and p.address == rep.address and len(p.assumed) > 0:
                try:
                    block = await p.task
                except (SpecdecError, DraftOut, asyncio.CancelledError):
                    block = None
                if block is not None and len(block.token_ids) < k:
                    block = None
            else:
                p.task.cancel()
            self.stats.pipeline_hits += block is not None
            self.stats.pipeline_misses += block is None
            (self.coord.metrics.pipeline_hits if block is not None else self.coord.metrics.pipeline_misses).inc()
        if block is None:
            for attempt in range(2):
                try:
                    block = await self._send_propose(rep, committed, digest, k, with_guess=pipeline)
                    break
                except NotFound:
                    self.draft_addr = None  # evicted or restarted: prefill it again
                except SpecdecError as exc:
                    self._draft_failed(rep, exc)
                    raise DraftOut() from None
            else:
                raise DraftOut()
        block = replace(block, token_ids=block.token_ids[:k],
                        draft_probs=None if block.draft_probs is None else block.draft_probs[:k],
                        guess=block.guess if len(block.token_ids) == k else None)
        if pipeline and block.guess is not None and len(block.token_ids) == k:
            ahead = list(block.token_ids) + [block.guess]
            assumed = committed + ahead
            next_k = min(self._step_k, self.checker.remaining - len(ahead) - 1)
            if next_k >= 1:
                task = asyncio.get_running_loop().create_task(
                    self._send_propose(rep, assumed, extend_digest(digest, ahead), next_k, True))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "never retrieved"
                self.pending = _Pending(tuple(assumed), rep.address, task)
        return block

    # --- target ----------------------------------------------------------------------------
    def _pick_target(self):
        """The session's target replica: its home while that is live (chosen once, at the first
        pick: the replica that read its longest prefix, coordinator.affinity), else the ring's."""
        pool = self.coord.target_pool
        if self.target_home is None or self.target_home not in pool.live():
            ring = pool.pick(self.session_id)
            self.target_home = self.coord.affinity.home(self.tokens, ring.address if ring else None, pool.live(),
                                                        self.coord.target_load)
        return pool.pick(self.session_id, prefer=self.target_home)

    async def _target(self):
        pool = self.coord.target_pool
        rep = self._pick_target()
        if rep is None:
            await pool.wait_for_live(self.coord.settings.target_wait_s)
            rep = self._pick_target()
            if rep is None:
                raise Unavailable(self._target_gone())
        return rep

    def _target_gone(self) -> str:
        """What a client reads when the target stays away: what happened and how to continue."""
        return (f"the target service is unavailable (waited {self.coord.settings.target_wait_s:.0f} s); "
                f"session {self.session_id} keeps its {len(self.generated)} tokens: resume it with its id")

    async def _on_target(self, call):
        """Run call(client, committed, known, digest) on the session's target replica, prefilling it when the
        replica is new to the session, and moving to another replica when it fails."""
        deadline = time.monotonic() + self.coord.settings.target_wait_s
        while True:
            rep = await self._target()
            client: TargetClient = rep.client
            committed, digest = list(self.tokens), self.digests.last()
            try:
                if rep.address != self.target_addr or not self.target_known:
                    # a prefill, or a call that carries every token (it starts the session there: _prefill_both),
                    # may reuse what the Releases in flight there keep
                    await self.coord.releases_landed(rep.address)
                if rep.address != self.target_addr:
                    self.target_addr, self.target_known = None, []
                    await client.prefill(self.session_id, committed)
                    self.target_addr, self.target_known = rep.address, list(committed)
                known = common_prefix_len(self.target_known, committed)
                self.target_known = self.target_known[:known]
                result = await call(client, committed, known, digest)
                self.target_known = committed + list(result.emitted)
                return result
            except NotFound:
                self.target_addr = None
            except (Unavailable, RemoteError) as exc:
                self.coord.target_pool.mark_failed(rep.address, str(exc))
                self.target_addr = None
            if time.monotonic() > deadline:
                raise Unavailable(self._target_gone())

    async def _verify(self, block: DraftBlock):
        async def call(client: TargetClient, committed, known, digest):
            return await client.verify(self.session_id, committed, known, block.token_ids, block.draft_probs,
                                       self.sampling, block.kind, digest=digest)

        v = await self._on_target(call)
        self.last_fully_accepted = v.num_drafted > 0 and v.num_accepted == v.num_drafted
        self.stats.target_forwards += 1
        self.stats.drafted += v.num_drafted
        self.stats.accepted += v.num_accepted
        return v

    async def _decode(self, method: str, max_tokens: int, fallback: bool) -> tuple[int, ...]:
        self._drop_pending()

        async def call(client: TargetClient, committed, known, digest):
            return await client.decode(self.session_id, committed, known, max_tokens, method, self.sampling,
                                       self.stop.eos_token_ids, digest=digest)

        res = await self._on_target(call)
        self.stats.target_forwards += res.target_forwards
        self.stats.drafted += res.num_drafted
        self.stats.accepted += res.num_accepted
        if fallback:
            self.stats.fallback_steps += res.target_forwards
            self.coord.metrics.fallback_steps.inc(res.target_forwards)
        return res.emitted

    # --- consumers -------------------------------------------------------------------------
    async def wait_until(self, have: int) -> None:
        """Wait until more than `have` tokens are generated, or the run ended."""
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.generated) > have or self.task is None or self.task.done())
