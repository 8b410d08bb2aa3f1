"""The coordinator without the wire: requests -> sessions (Redis) -> runs; streams and resumes.

A run belongs to the coordinator process that started it; a client that reconnects with the
session id (and how many tokens it already has) is attached to the live run, or, when no run
is live here (the client was cancelled, or this coordinator restarted), the session continues
from its committed tokens in Redis. A client that goes away stops the work: when the last
consumer of a run leaves before it finished, the run is cancelled and the session paused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Optional, Sequence

from specdec.errors import FailedPrecondition, InvalidRequest, NotFound, Overloaded, SpecdecError, Unavailable
from specdec.service.metrics import ServiceMetrics
from specdec.sessions import check_session_id, check_token_ids
from specdec.costmodel import CostStore, acceptance_can_pay, acceptance_upper_bound, best_k, verify_cost_at
from specdec.step_choice import ACCEPTANCE_KEY, DraftCost, StepRates
from coordinator.affinity import PrefixAffinity
from coordinator.slots import SessionSlots
from specdec.stopping import IncrementalText, StopChecker, cut_at_stop_string
from specdec.types import ModelInfo, SamplingParams, StopConditions
from coordinator.records import STORE_DOWN, SessionRecord
from coordinator.routing import ReplicaPool
from coordinator.run import RunStats, SessionRun
from coordinator.settings import CoordinatorSettings

if TYPE_CHECKING:
    from coordinator.sessions import SessionStore

log = logging.getLogger("coordinator")


def check_prompt_chars(chars: int, max_positions: int, longest_token_chars: int) -> None:
    """Refuse a prompt that cannot fit the context before tokenizing it (a multi-megabyte prompt
    takes seconds to tokenize). No token stands for more characters than the longest entry of the
    vocabulary (byte-level BPE: one character per byte; a normalizer that shrinks text would break
    this bound, none of ours does), so a prompt of more than max_positions x that many characters
    holds more tokens than the context. The exact count is checked after tokenizing."""
    limit = max_positions * max(longest_token_chars, 1)
    if chars > limit:
        raise InvalidRequest(f"the prompt has {chars} characters: more than the model's context of {max_positions} "
                             f"tokens can hold (at most {limit} characters)")


def same_request(new: SessionRecord, stored: SessionRecord) -> bool:
    """Whether a request naming an existing session asks for exactly what it holds: the same
    prompt tokens and settings. Anything else would silently answer another question."""
    return new.tokens == stored.tokens[:stored.prompt_len] and new.params == stored.params


def text_after(full: str, before: str) -> str:
    """The part of `full` after `before` (the text of the tokens a client already has). A character
    cut in half at the end of `before` (shown as U+FFFD) is sent again whole."""
    before = before.rstrip("\ufffd")
    return full[len(os.path.commonprefix([full, before])):]


@dataclass(frozen=True)
class Prompt:
    text: Optional[str] = None
    token_ids: Optional[Sequence[int]] = None
    chat: Optional[Sequence[tuple[str, str]]] = None


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    method: str = ""
    k: int = 0
    session_id: str = ""
    resume_from: int = 0


@dataclass(frozen=True)
class Update:
    """What a stream sends: tokens from `offset` on, a text delta, and the end."""

    offset: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str = ""
    stats: Optional[RunStats] = None


K_EVIDENCE = 32  # drafted tokens judged before the cost model chooses a draft step's k


class Coordinator:
    def __init__(self, store: SessionStore, draft_pool: ReplicaPool, target_pool: ReplicaPool,
                 settings: CoordinatorSettings = CoordinatorSettings(), metrics: Optional[ServiceMetrics] = None,
                 costs: Optional[CostStore] = None):
        """costs: where drafting's measured acceptance is kept (default: in memory, for this process)."""
        self.store = store
        self.costs = costs if costs is not None else CostStore()
        self.draft_pool = draft_pool
        self.target_pool = target_pool
        self.settings = settings
        self.metrics = metrics or ServiceMetrics("coordinator")
        self.runs: dict[str, SessionRun] = {}
        self.background: set[asyncio.Task] = set()  # fire-and-forget calls (cache releases)
        self._releasing: dict[str, set[asyncio.Task]] = {}  # per target replica: finished sessions' Releases in flight
        self.step_rates = StepRates()  # auto: drafting or the target alone, by measured cost per token
        self.draft_costs: dict[str, DraftCost] = {}  # per draft model: its c as the draft steps measure it
        self.affinity = PrefixAffinity()  # which target replica read which prefixes (a new session's home)
        self.slots = SessionSlots(settings.sessions_per_target, lambda: len(self.target_pool.live()),
                                  on_change=self.metrics.sessions_waiting.set)
        self._info: Optional[ModelInfo] = None
        self._tokenizer = None
        self._longest_token = 1  # characters of the tokenizer's longest vocabulary entry
        self._tokenizer_dir: Optional[tempfile.TemporaryDirectory] = None
        self._info_lock = asyncio.Lock()
        self.store_ok = True  # the last answer of the store watcher
        self.on_store_change: Optional[Callable[[bool], Awaitable[None]]] = None  # e.g. health SERVING / NOT_SERVING
        self._store_watch: Optional[asyncio.Task] = None
        self._targets_watch: Optional[asyncio.Task] = None
        self._warming: Optional[asyncio.Task] = None
        self._store_recheck: Optional[asyncio.Future] = None

    def start(self) -> None:
        self.draft_pool.start()
        self.target_pool.start()
        self._store_watch = asyncio.get_running_loop().create_task(self._watch_store())
        self._targets_watch = asyncio.get_running_loop().create_task(self._watch_targets())
        self._warming = asyncio.get_running_loop().create_task(self._warm_up())

    @property
    def warming(self) -> bool:
        """Whether the start-up warm-up still runs (the HTTP health says not ready meanwhile)."""
        return self._warming is not None and not self._warming.done()

    async def _warm_up(self) -> None:
        """Fetch the target's info and tokenizer and apply the chat template once, in the
        background at start, before the first request needs them (measured: the first chat
        request spent ~0.75 s of the coordinator's CPU on them, then none)."""
        try:
            await self.info()
            if self._tokenizer is not None:
                await self.encode(Prompt(chat=[("user", "Hello!")]))
                self.detokenize(await self.encode(Prompt(text="Hello!")))
        except (SpecdecError, OSError, ValueError) as exc:  # the first request tries again and says why
            log.info("warm-up skipped: %s", exc)

    async def _watch_targets(self) -> None:
        """Target replicas that join bring free slots to the sessions waiting for one."""
        while True:
            await self.target_pool.changed.wait()
            self.slots.wake()

    async def _watch_store(self) -> None:
        """Ping Redis in the background (not per request) and report each change: without its
        session store the coordinator can serve nothing, and its health must say so."""
        while True:
            await self._store_seen(await self.store.ping())
            await asyncio.sleep(self.settings.probe_interval_s)

    async def _store_seen(self, ok: bool) -> None:
        if ok != self.store_ok:
            self.store_ok = ok
            (log.info if ok else log.warning)("session store %s", "reachable again" if ok else "unreachable")
            if self.on_store_change is not None:
                await self.on_store_change(ok)

    async def _store_back(self) -> bool:
        """A request while the store is marked down asks Redis itself (one ping shared by all such
        requests, at most a second): Redis back between two watcher pings serves new sessions at once."""
        if self._store_recheck is None or self._store_recheck.done():
            self._store_recheck = asyncio.ensure_future(self.store.ping())
        try:
            async with asyncio.timeout(1.0):
                ok = await asyncio.shield(self._store_recheck)
        except TimeoutError:
            return False
        if ok:
            await self._store_seen(True)
        return ok

    # --- the target's model facts, fetched once ---------------------------------------------
    async def info(self) -> ModelInfo:
        if self._info is not None:
            return self._info
        async with self._info_lock:
            if self._info is None:
                if not await self.target_pool.wait_for_live(self.settings.target_wait_s):
                    raise Unavailable("no target replica is available")
                rep = self.target_pool.pick("info")
                self._info = await rep.client.info()
                self._tokenizer = self._load_tokenizer(self._info.tokenizer_files)
        return self._info

    async def draft_fits(self, rep) -> bool:
        """Check a draft replica's vocabulary against the target's once; a misfit is refused for good."""
        if rep.checked:
            return rep.usable
        info = await rep.client.info()
        target = await self.info()
        rep.checked, rep.model = True, info.name
        if info.vocab_size != target.vocab_size:
            self.draft_pool.mark_unusable(rep.address, f"its vocabulary ({info.vocab_size} tokens) differs from the "
                                                       f"target's ({target.vocab_size})")
        return rep.usable

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size if self._info else 0

    @property
    def drafting_cannot_pay(self) -> bool:
        """The target says no draft could pay on it (its measured verify cost): auto never drafts."""
        return bool(self._info and self._info.drafting_cannot_pay)

    def draft_hopeless(self, rep) -> bool:
        """Whether the draft replica's measured acceptance on this target (its drafted tokens
        judged here, and in earlier runs where the cost store is on disk) says, with 95%
        confidence, that it could not pay even if drafting cost nothing, on the target's measured
        verify cost (costmodel.acceptance_can_pay at acceptance_upper_bound): auto then leaves
        the draft idle (StepRates.choose)."""
        got = self._draft_counts(rep)
        return got is not None and not acceptance_can_pay(self._info.verify_cost, acceptance_upper_bound(got[1], got[0]))

    def draft_k(self, rep) -> int:
        """Tokens a draft step drafts when the client left k to the coordinator: the k at which
        the cost model predicts the highest speedup (costmodel.best_k, at most max_k) from the
        draft's measured acceptance on this target, its measured c (DraftCost) and the target's
        verify cost, as `specdec generate`'s k auto weighs them; default_k until all are known
        (the acceptance from at least K_EVIDENCE judged tokens: a first step's one or two say little)."""
        info = self._info
        top = min(self.settings.max_k, (info.max_k if info else 0) or self.settings.max_k)
        got = self._draft_counts(rep)
        cost = self.draft_costs.get(rep.model) if got is not None else None
        if cost is None or cost.c is None or got[0] < K_EVIDENCE:
            return min(self.settings.default_k, top)
        return best_k(got[1] / got[0], cost.c, info.verify_cost, range(1, top + 1))

    def _draft_counts(self, rep) -> Optional[tuple[float, float]]:
        """The draft replica's judged and accepted tokens on this target (cost store), or None
        while unknown, or while the target's verify cost, which they are weighed against, is."""
        info = self._info
        if rep is None or not rep.model or info is None or not info.verify_cost:
            return None
        return self.costs.acceptance_counts(info.name, ACCEPTANCE_KEY, rep.model)

    def draft_step_seen(self, rep, k: int, propose_s: float, verify_s: float) -> None:
        """A typical draft step's Propose and Verify seconds: the draft's c (DraftCost)."""
        if self._info is None or not self._info.verify_cost:
            return
        cost = self.draft_costs.setdefault(rep.model, DraftCost())
        cost.record(k, propose_s, verify_s, verify_cost_at(self._info.verify_cost, k + 1))

    def _keep_acceptance(self, run: SessionRun) -> None:
        """A run's drafted tokens judged and accepted, per draft model, into the cost store."""
        if self._info is None:
            return
        for model, (judged, accepted) in run.draft_judged.items():
            self.costs.add_acceptance(self._info.name, ACCEPTANCE_KEY, judged, accepted, proposer=model)

    def _load_tokenizer(self, files: dict[str, bytes]):
        if "tokenizer.json" not in files and "tokenizer_config.json" not in files:
            return None
        from transformers import AutoTokenizer

        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="specdec-tokenizer-")
        for name, data in files.items():
            with open(os.path.join(self._tokenizer_dir.name, os.path.basename(name)), "wb") as fh:
                fh.write(data)
        tok = AutoTokenizer.from_pretrained(self._tokenizer_dir.name)
        self._longest_token = max((len(t) for t in tok.get_vocab()), default=1)
        return tok

    def _need_tokenizer(self):
        if self._tokenizer is None:
            raise InvalidRequest("the target serves no tokenizer: send token ids")
        return self._tokenizer

    def detokenize(self, ids: Sequence[int]) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    async def encode(self, prompt: Prompt) -> list[int]:
        """Prompt -> token ids. Size is checked first; tokenizing runs in a worker thread (the
        tokenizer releases the GIL), so a large prompt never holds up other sessions' streams."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.chat)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one prompt: text, token_ids or chat messages")
        if prompt.token_ids is not None:
            if not prompt.token_ids:
                raise InvalidRequest("the prompt is empty")
            if len(prompt.token_ids) >= self._info.max_positions:  # before looking at a million ids
                raise InvalidRequest(f"the prompt has {len(prompt.token_ids)} tokens: the model's context is "
                                     f"{self._info.max_positions}")
            return check_token_ids(prompt.token_ids, self.vocab_size, "prompt token ids")
        if prompt.text is not None:
            if not prompt.text.strip():
                raise InvalidRequest("the prompt is empty")
            tok = self._need_tokenizer()
            check_prompt_chars(len(prompt.text), self._info.max_positions, self._longest_token)
            return await asyncio.to_thread(lambda: list(tok(prompt.text, add_special_tokens=True)["input_ids"]))
        if not prompt.chat or not any(c.strip() for _, c in prompt.chat):
            raise InvalidRequest("the prompt is empty")
        tok = self._need_tokenizer()
        for role, _ in prompt.chat:
            if role not in ("system", "user", "assistant"):
                raise InvalidRequest(f"chat role must be system, user or assistant, got {role[:20]!r}")
        check_prompt_chars(sum(len(c) for _, c in prompt.chat), self._info.max_positions, self._longest_token)

        def apply_template() -> list[int]:
            ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in prompt.chat],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        return await asyncio.to_thread(apply_template)

    # --- requests -------------------------------------------------------------------------
    def methods(self, info: ModelInfo) -> tuple[str, ...]:
        """What a request's method may name: auto, the draft service, or a target-side method."""
        return ("auto", "draft", "target", *info.methods)

    async def _new_record(self, req: Request, session_id: str) -> SessionRecord:
        info = await self.info()
        ids = await self.encode(req.prompt)
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        if len(ids) + max_tokens + 1 > info.max_positions:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                 f"context of {info.max_positions} tokens")
        k = req.k  # 0: the cost model's (draft_k)
        max_k = min(self.settings.max_k, info.max_k or self.settings.max_k)
        if k and not 1 <= k <= max_k:
            raise InvalidRequest(f"k must be in [1, {max_k}], got {k}")
        method = req.method or "auto"
        if method not in self.methods(info):
            raise InvalidRequest(f"unknown method {method!r}; choose one of {', '.join(self.methods(info))}")
        if req.stop and self._tokenizer is None:
            raise InvalidRequest("stop strings need the target's tokenizer")
        StopConditions(max_new_tokens=max_tokens, stop_strings=tuple(req.stop))  # validates
        s = req.sampling
        params = dict(sampling=dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed),
                      max_tokens=max_tokens, stop=list(req.stop), eos=list(info.eos_token_ids), method=method, k=k)
        return SessionRecord(session_id=session_id, prompt_len=len(ids), tokens=ids, params=params)

    def _run_for(self, rec: SessionRecord) -> SessionRun:
        p = rec.params
        stop = StopConditions(max_new_tokens=p["max_tokens"], eos_token_ids=tuple(p["eos"]),
                              stop_strings=tuple(p["stop"]))
        checker = StopChecker(stop, self.detokenize if stop.stop_strings else None)
        checker.push(rec.generated)  # a resumed session continues where it stopped
        stats = RunStats(**{k: v for k, v in rec.stats.items() if k in RunStats.__dataclass_fields__})
        return SessionRun(self, rec, SamplingParams(**p["sampling"]), stop, p["method"], p["k"], checker, stats)

    async def open(self, req: Request, stream: bool = True) -> tuple[SessionRun, int]:
        """-> (the session's run, the generated-token offset the client starts from). stream:
        whether the client follows the tokens as they come (False: it waits for the whole answer)."""
        t0 = time.perf_counter()
        try:
            return await self._open(req, stream)
        finally:
            self.metrics.step_phase.labels(phase="open").observe(time.perf_counter() - t0)

    async def _open(self, req: Request, stream: bool) -> tuple[SessionRun, int]:
        if req.resume_from < 0:
            raise InvalidRequest(f"resume_from must be >= 0, got {req.resume_from}")
        if not self.store_ok and not await self._store_back():
            raise Unavailable(STORE_DOWN)
        session_id = check_session_id(req.session_id) if req.session_id else uuid.uuid4().hex
        await self.info()
        run = self.runs.get(session_id)
        if run is not None and run.task is not None and (run.task.done() or run.task.cancelling()):
            await asyncio.wait([run.task])  # a run being paused: let it finish writing, then continue from Redis
            run = self.runs.get(session_id)
        stored = run.rec if run is not None else None
        created = None
        if run is None:
            try:
                if not req.session_id:  # an id made here (a fresh uuid4): Redis cannot hold it, and a read costs
                    raise NotFound(f"unknown session {session_id}")
                rec = stored = await self.store.load(session_id)
            except NotFound:
                if req.resume_from or req.prompt == Prompt():  # resuming, or nothing to start from
                    raise
                rec = await self._new_record(req, session_id)
                if not req.session_id:
                    # Nobody else can create it: the write goes beside the first step, which commits after it
                    # (SessionRun._created; measured: ~1.5 ms of a one-token request's 25 through specdec up)
                    created = asyncio.ensure_future(self.store.create(rec))
                    created.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read by the run)
                elif not await self.store.create(rec):  # lost a race with a concurrent create
                    rec = stored = await self.store.load(session_id)
        if stored is not None and req.prompt != Prompt():
            # A prompt with an existing session's id: only an exact resume continues it.
            if not same_request(await self._new_record(req, session_id), stored):
                raise FailedPrecondition(f"session {session_id} exists with another prompt or settings: resume it "
                                         f"with the same ones (or none), or use a new session id")
        if run is None:
            run = self.runs.get(session_id)
            if run is None:
                run = self._run_for(rec)
                run.streamed, run.created = stream, created
                if not run.finished and rec.status != "done":
                    if sum(not r.finished for r in self.runs.values()) >= self.settings.max_active:
                        raise Overloaded(f"{self.settings.max_active} generations running: try again later")
                    self.runs[session_id] = run
                    self.metrics.sessions.set(len(self.runs))
                    run.start()
        if req.resume_from > len(run.generated):
            raise InvalidRequest(f"resume_from {req.resume_from} is beyond the {len(run.generated)} tokens generated")
        run.streamed = run.streamed or stream  # (a run a stream joins streams from now on)
        return run, req.resume_from

    def release_behind(self, rep, session_id: str) -> None:
        """Release a finished session on its target replica while its answer goes out (measured: a
        Release held a one-token request 1.5-3.7 ms through specdec up). The replica keeps the
        session's KV in its prefix cache on Release, so the next Prefill sent to it from here waits
        for the Releases in flight there first (releases_landed): a conversation's next turn, sent
        the moment its answer arrives, still finds the turn before."""
        async def release() -> None:
            try:
                await rep.client.release(session_id)
            except SpecdecError:
                pass  # best effort: LRU eviction is the backstop

        task = asyncio.get_running_loop().create_task(release())
        here = self._releasing.setdefault(rep.address, set())
        here.add(task)
        self.background.add(task)

        def landed(t: asyncio.Task) -> None:
            here.discard(t)
            self.background.discard(t)
            if not here and self._releasing.get(rep.address) is here:
                del self._releasing[rep.address]
        task.add_done_callback(landed)

    async def releases_landed(self, address: str) -> None:
        """Wait for the Releases in flight on this target replica (release_behind)."""
        tasks = self._releasing.get(address)
        if tasks:
            await asyncio.wait(list(tasks))

    def target_load(self, address: str) -> int:
        """Sessions running with their home on this target replica."""
        return sum(1 for r in self.runs.values() if r.target_home == address and not r.finished)

    def run_ended(self, run: SessionRun) -> None:
        self._keep_acceptance(run)
        if self.runs.get(run.session_id) is run:
            del self.runs[run.session_id]
        self.metrics.sessions.set(len(self.runs))

    def text(self, run: SessionRun, upto: Optional[int] = None) -> str:
        ids = run.generated if upto is None else run.generated[:upto]
        return cut_at_stop_string(self.detokenize(ids), run.stop.stop_strings)

    def text_from(self, run: SessionRun, offset: int) -> str:
        """The text that follows the client's first `offset` generated tokens (a unary resume)."""
        return text_after(self.text(run), self.text(run, offset)) if offset else self.text(run)

    async def follow(self, run: SessionRun, offset: int) -> AsyncIterator[Update]:
        """A session's updates from the client's offset until it finishes.

        Leaving early (cancellation) detaches; the last consumer to leave pauses the run."""
        decoded = IncrementalText(self.detokenize, run.generated[:offset])  # decodes only new tokens per step
        sent_text = cut_at_stop_string(decoded.text, run.stop.stop_strings)
        run.consumers += 1
        try:
            while True:
                await run.wait_until(offset)
                gen = run.generated
                if len(gen) > offset:
                    t0 = time.perf_counter()
                    decoded.push(gen[offset:])
                    # The last piece from the whole text decoded once more, exactly as a unary answer's.
                    text = (self.text(run, len(gen)) if run.finished
                            else cut_at_stop_string(decoded.text, run.stop.stop_strings))
                    # Hold back an incomplete multi-byte character; never resend text.
                    safe = text.rstrip("\ufffd") if not run.finished else text
                    delta = safe[len(sent_text):] if safe.startswith(sent_text) else ""
                    sent_text = sent_text + delta
                    self.metrics.step_phase.labels(phase="detokenize").observe(time.perf_counter() - t0)
                    yield Update(offset, tuple(gen[offset:]), delta)
                    offset = len(gen)
                    continue
                if run.finished:
                    yield Update(offset, (), "", run.checker.finish_reason, run.stats)
                    return
                if run.error is not None:
                    raise run.error
                if run.task is not None and run.task.done():
                    raise Unavailable("the session stopped before finishing; resume it with its id")
        finally:
            run.consumers -= 1
            if run.consumers == 0 and run.task is not None and not run.task.done():
                run.task.cancel()

    async def generate(self, req: Request) -> tuple[SessionRun, int]:
        """Unary: wait for the whole answer; -> (the finished run, the client's offset)."""
        run, offset = await self.open(req, stream=False)
        async for _ in self.follow(run, offset):
            pass
        return run, offset

    async def close(self) -> None:
        for watch in (self._store_watch, self._targets_watch, self._warming):
            if watch is not None:
                watch.cancel()
        for run in list(self.runs.values()):
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in list(self.runs.values()) if r.task), return_exceptions=True)
        if self.background:  # the releases in flight land first: the replicas free those sessions' KV now
            await asyncio.wait(list(self.background), timeout=self.settings.release_wait_s)
        for task in list(self.background):  # what did not land is cancelled while its channel is still open
            task.cancel()
        if self.background:
            await asyncio.wait(list(self.background), timeout=self.settings.release_wait_s)
        await self.draft_pool.close()
        await self.target_pool.close()
        await self.store.close()
        if self._tokenizer_dir is not None:
            self._tokenizer_dir.cleanup()
