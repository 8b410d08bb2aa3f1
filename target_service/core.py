"""The target service without the wire: per-session KV caches (LRU-bounded), Verify steps of
concurrent sessions batched into one forward (specdec.verify), and target-side Decode with
the registered proposers (plain, and Medusa / Lookahead / prompt lookup when available).

Each session keeps the committed tokens it last saw and a cache holding all but the last one
(right after a load, all of them and the logits after the last, whence its next plain token).
Every request names its position (committed length + digest, plus the newest tokens); a
session that is missing, evicted or stale is refused with NotFound and the caller prefills it
again from its own copy of the tokens (Redis). A request behind the session (it applied a call
whose answer was lost) rolls the session back first, so every call is safe to repeat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from specdec.costmodel import CostStore
from specdec.decode import KSchedule, RowProgress
from specdec.errors import FailedPrecondition, InvalidRequest, NotFound
from specdec.backends.hf import CausalLM, feature_rows, tap_request
from specdec.prefix_cache import PrefixCache, remember, restore_longest
from specdec.token_history import MAX_DRAFT, HistoryProposer, MatchAcceptance, TokenHistory, drafts_for
from specdec.service.memory import IdleTrim
from specdec.models import user_cost_store
from specdec.proposers import PROPOSERS, Proposer, ProposerEnv, ProposerFactory, load_proposer
from specdec.service.batching import MicroBatcher
from specdec.service.metrics import ServiceMetrics
from specdec.service.session_table import SessionTable
from specdec.service.sync import Position, check_position, synced_tokens
from specdec.sampling import make_generator, next_token
from specdec.sessions import PrefixDigests, check_token_ids, step_seed
from specdec.stopping import StopChecker
from specdec.types import DecodeResult, DraftKind, Proposal, ProposeContext, SamplingParams, StopConditions, Verdict
from specdec.verify import RowStep, common_prefix_len, load_committed, verify_sessions

log = logging.getLogger("target_service")

# Decode(method="") picks the first of these that is loaded.
FALLBACK_ORDER = ("medusa", "lookahead", "plain")
# Each session's target-side proposer holds that one session, as its row 0.
SESSION_ROW = 0
# The Decode methods history drafts go with (specdec.token_history): plain, and prompt lookup, whose
# drafts (chains that need no hidden state) stand in where the history has none.
HISTORY_BESIDE = ("plain", "prompt-lookup")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


@dataclass(frozen=True)
class TargetSettings:
    max_sessions: int = 64  # KV caches kept; the least recently used is evicted beyond this
    max_batch: int = 8  # sessions per verification forward
    batch_window_ms: float = 2.0  # how long the first request of a batch waits for company
    max_k: int = 32  # most drafted tokens per Verify
    max_queue: int = 256  # queued steps beyond this are refused (RESOURCE_EXHAUSTED)
    # The prefix cache's budget (0: off). SmolLM2-135M holds ~23 KB of KV a token on llama.cpp
    # (f16) and ~46 KB on torch (float32): 1 GiB keeps 20-45 thousand tokens of prompts and turns.
    prefix_cache_mb: int = 1024
    # LOSSY on llama.cpp (opt-in): reuse any cached prefix, a conversation's decoded answer and part
    # blocks too, as llama-server's cache_prompt does. A next turn starts sooner, but its answer may
    # part from a fresh prefill's at near-ties (specdec.prefix_cache); torch reuses any prefix anyway.
    prefix_cache_any: bool = False
    # On llama.cpp: concurrent sessions on sequences of shared contexts, a context's plain steps in one
    # llama_decode (LlamaCppLM.share_context; outputs then agree with plain decoding up to near-ties
    # of llama.cpp's batch-size rounding). Off by default: through `specdec up` 8 streams gained
    # nothing yet (bench/results-serve/README.md), whatever the backend alone gains.
    join_sessions: bool = False
    # Drafts from earlier sessions (specdec.token_history): the prompts and answers of recent
    # sessions, up to this many tokens (up to ~250 bytes each; 0: off). A Decode on the target alone
    # (plain) drafts what followed where a session's end matches token_history.MIN_MATCH tokens or
    # more of them: a prompt that comes again, a conversation re-sent with the same tool calls.
    history_tokens: int = 1 << 17


@dataclass
class TargetSession:
    session_id: str
    tokens: list[int] = field(default_factory=list)  # committed tokens; the cache holds all but the last
    digests: PrefixDigests = field(default_factory=PrefixDigests)  # of every prefix of `tokens`
    cache: Optional[object] = None  # KVCache, batch 1
    # The first committed tokens whose KV a prefill computed from an empty or restored start (the rest
    # were decoded): of those, the prefix cache keeps whole prefill blocks (specdec.prefix_cache)
    prefilled: int = 0
    hidden: Optional[torch.Tensor] = None  # [hidden] state that produced tokens[-1], if known
    # The target's states ([n, hidden] pieces) at the committed positions not yet handed to the
    # session's feature-reading proposer (EAGLE); None: some position's state was never computed
    # (a Verify, another method, a resync), so such a proposer reads the whole session again first.
    features: Optional[list[torch.Tensor]] = None
    proposers: dict[str, Proposer] = field(default_factory=dict)  # target-side proposers used by Decode
    # [vocab] the logits after the last committed token where the cache holds every committed token
    # (a load fed them all: _load): the next plain step takes its token from them, no forward of its own
    last_logits: Optional[torch.Tensor] = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Step:
    session: TargetSession
    position: Optional[Position]  # None: already in sync (a later step of the same Decode)
    draft_ids: tuple[int, ...] = ()
    draft_probs: Optional[torch.Tensor] = None  # [k, vocab]
    sampling: SamplingParams = SamplingParams()
    proposer: Optional[Proposer] = None  # Decode: propose on the model thread right before the forward
    # Decode: the call's bookkeeping. Its steps record their verdicts here, on the model thread, and
    # go on there (no hop back to the event loop per token) until it is done or other work waits.
    progress: Optional[RowProgress] = None
    abandoned: bool = False  # Decode: its caller is gone (cancelled): the model thread takes no more of its forwards

    @property
    def proposer_k(self) -> int:
        return self.progress.block_k() if self.proposer is not None and self.progress is not None else 0


def check_draft(kind: Optional[DraftKind], k: int, draft_probs: Optional[torch.Tensor],
                sampling: SamplingParams) -> Optional[torch.Tensor]:
    """A Verify's draft as the acceptance rule needs it: -> draft_probs [k, vocab], or None for a
    deterministic draft. Under sampling the kind must be said rather than guessed from whether
    probabilities came along: a sampled draft verified as one-hot still yields the target's
    distribution (any token fixed before the target's draws is a valid one-hot draft) but is kept
    with probability target_probs[x] instead of min(1, target_probs[x] / draft_probs[x]), so a
    client that lost its probabilities would only see its acceptance collapse, silently."""
    if sampling.greedy or k == 0:
        return None  # greedy acceptance and a plain step never read a draft distribution
    if kind is None:
        raise InvalidRequest("draft_kind is required when sampling: DETERMINISTIC for argmax or lookup drafts, "
                             "SAMPLED (with draft_probs) for sampled ones")
    if kind is DraftKind.SAMPLED and draft_probs is None:
        raise InvalidRequest("a SAMPLED draft needs its draft_probs when sampling (rejection sampling reads them)")
    if kind is DraftKind.DETERMINISTIC and draft_probs is not None:
        raise InvalidRequest("a DETERMINISTIC draft carries no draft_probs")
    return draft_probs


class TargetCore:
    def __init__(self, target: CausalLM, settings: TargetSettings = TargetSettings(),
                 metrics: Optional[ServiceMetrics] = None, tokenizer_dir: Optional[str] = None,
                 methods: Optional[dict[str, ProposerFactory]] = None, costs: Optional[CostStore] = None,
                 executor: Optional[concurrent.futures.Executor] = None):
        self.target = target
        self.settings = settings
        self.costs = costs if costs is not None else user_cost_store()
        self._local_method: Optional[str] = None
        self._drafting_cannot_pay: Optional[bool] = None
        # KV of prompts and finished sessions, reused by later sessions that start the same way
        self.prefix_cache: Optional[PrefixCache] = None
        self.reuse_block = 1 if settings.prefix_cache_any else target.prefill_block  # (specdec.prefix_cache)
        if settings.prefix_cache_mb > 0:  # (every backend snapshots and restores a prefix)
            self.prefix_cache = PrefixCache(settings.prefix_cache_mb << 20, on_change=self._prefix_cache_changed)
            log.info("prefix cache: up to %d MiB of KV, blocks of %d tokens", settings.prefix_cache_mb,
                     self.prefix_cache.block)
        self.history: Optional[TokenHistory] = None
        self.history_acceptance = MatchAcceptance()  # (shared by every session's history drafts)
        if settings.history_tokens > 0:
            self.history = TokenHistory(settings.history_tokens)
            log.info("history drafts: the last %d tokens of finished sessions", settings.history_tokens)
        share_context = getattr(target, "share_context", None)
        if settings.join_sessions and share_context is not None:
            share_context(settings.max_batch)
        self.metrics = metrics or ServiceMetrics("target")
        self.tokenizer_dir = tokenizer_dir
        self.sessions: SessionTable[TargetSession] = SessionTable(settings.max_sessions, TargetSession,
                                                                  self.metrics.sessions, on_count=IdleTrim())
        # Per session id: how often it was (re)built here, kept past its release (the most recent
        # ids only): the one per-session record of rebuilds, which the failover tests check.
        self.prefills: OrderedDict[str, int] = OrderedDict()
        self.methods = methods if methods is not None else discover_methods(target, self.costs)
        self.batcher = MicroBatcher(self._run_steps, max_batch=settings.max_batch,
                                    window_s=settings.batch_window_ms / 1000, max_queue=settings.max_queue,
                                    metrics=self.metrics, expect_company=self.sessions.active_recently,
                                    executor=executor)

    # --- sessions --------------------------------------------------------------------------
    def _session(self, session_id: str, create: bool = False) -> TargetSession:
        return self.sessions.get(session_id, create)

    async def release(self, session_id: str) -> bool:
        """Forget a session; its KV is kept in the prefix cache first (a conversation's next turn
        starts with this one's tokens), its tokens in the history (later sessions draft from them)."""
        if (self.prefix_cache is not None or self.history is not None) and session_id in self.sessions:
            sess = self.sessions.get(session_id)
            async with sess.lock:
                await self.batcher.run_alone(lambda: self._retire(sess))
        return self.sessions.release(session_id)

    def _retire(self, sess: TargetSession) -> None:
        if self.prefix_cache is not None:
            self._remember(sess)
        if self.history is not None:
            self.history.add(sess.tokens)
            self.metrics.history_tokens.set(self.history.tokens)

    # --- the prefix cache (model thread) ------------------------------------------------------
    def _reuse_prefix(self, sess: TargetSession, tokens: list[int]) -> list[int]:
        """Restore the longest cached prefix of tokens[:-1] when it holds more than the session's
        own cache does -> the tokens the session's cache now stands for."""
        have = min(int(sess.cache.lengths[0]), common_prefix_len(sess.tokens, tokens))
        fresh = sess.cache if not sess.tokens else None  # a new session's cache, never fed: restore into it
        queried = self.prefix_cache.stats.queries
        n, kv = restore_longest(self.prefix_cache, self.target, tokens, at_most=len(tokens) - 1, more_than=have,
                                into=fresh, block=self.reuse_block)
        self.metrics.prefix_cache_queries.inc(self.prefix_cache.stats.queries - queried)  # 0: too short to look up
        if kv is None:
            return sess.tokens
        sess.cache, sess.prefilled = kv, n
        self.metrics.prefix_cache_hits.inc(n)
        return tokens[:n]

    def _remember(self, sess: TargetSession) -> None:
        """Keep the session's KV (all its committed tokens but the last, which its cache holds)."""
        if sess.cache is not None:
            remember(self.prefix_cache, self.target, sess.cache, sess.tokens[:-1], prefilled=sess.prefilled,
                     block=self.reuse_block)

    def _prefix_cache_changed(self, cache: PrefixCache, evicted: int) -> None:
        self.metrics.prefix_cache_bytes.set(cache.bytes_held)
        self.metrics.prefix_cache_evictions.inc(evicted)

    def _check_tokens(self, token_ids: Sequence[int], what: str) -> list[int]:
        return check_token_ids(token_ids, self.target.vocab_size, what)

    def _check_position(self, pos: Position, ahead: int) -> None:
        check_position(pos, self.target.vocab_size, ahead, self.target.max_positions)

    async def prefill(self, session_id: str, token_ids: Sequence[int]) -> int:
        ids = self._check_tokens(token_ids, "prompt token ids")
        if not ids:
            raise InvalidRequest("prefill needs at least one token")
        if len(ids) + 1 > self.target.max_positions:
            raise InvalidRequest(f"{len(ids)} tokens exceed the model's context of {self.target.max_positions}")
        sess = self._session(session_id, create=True)
        async with sess.lock:
            n = await self.batcher.run_alone(lambda: self._start(sess, ids))
        self._built(session_id)
        return n

    def _start(self, sess: TargetSession, ids: list[int]) -> int:
        """Load a session's prompt (a Prefill, or the first Verify or Decode of a session the caller
        names from its first token: _sync) -> its length (model thread)."""
        if sess.cache is None:
            sess.cache = self.target.new_cache(1)
        self._load(sess, ids)
        if self.prefix_cache is not None:
            self._remember(sess)  # the prompt: a system prompt or document other sessions share
        return len(ids)

    def _built(self, session_id: str) -> None:
        """Count a session (re)built here (event loop)."""
        self.metrics.session_rebuilds.inc()
        self.prefills[session_id] = self.prefills.get(session_id, 0) + 1
        self.prefills.move_to_end(session_id)
        while len(self.prefills) > 10 * self.settings.max_sessions:
            self.prefills.popitem(last=False)

    def _named_session(self, session_id: str, pos: Position) -> tuple[TargetSession, bool]:
        """A Verify's or Decode's session -> (it, whether this call builds it): a position that
        names every committed token (base 0) starts a session this replica does not hold, so a
        caller with nothing to load beside it saves the Prefill round trip (measured: 2-3 ms of a
        one-token request through specdec up); any other position of an unknown session is NotFound."""
        new = pos.base == 0 and session_id not in self.sessions
        return self._session(session_id, create=new), new

    def _sync(self, sess: TargetSession, pos: Position) -> None:
        """Bring the session to the caller's committed tokens (model thread)."""
        if sess.cache is None:
            if pos.base:
                raise NotFound(f"session {sess.session_id} is behind the caller: prefill it again")
            self._start(sess, list(pos.new_token_ids))
            return
        tokens = synced_tokens(sess.session_id, sess.tokens, sess.digests, pos)
        if tokens != sess.tokens:
            self._load(sess, tokens)

    def _load(self, sess: TargetSession, tokens: list[int]) -> None:
        """Make the session hold these committed tokens, keeping what its cache shares with them
        (or, when the prefix cache holds more of them, starting from that)."""
        cached = sess.tokens if self.prefix_cache is None else self._reuse_prefix(sess, tokens)
        kept = min(int(sess.cache.lengths[0]), common_prefix_len(cached, tokens), len(tokens) - 1)
        sess.last_logits = None  # (a load that fails leaves none)
        sess.last_logits = load_committed(self.target, sess.cache, tokens, cached=cached, through_last=True)
        # what it fed was prefilled in whole blocks from `kept` on: exact rows where those before were
        exact_start = kept <= sess.prefilled and kept % self.reuse_block == 0
        sess.prefilled = len(tokens) if exact_start else min(sess.prefilled, kept)
        sess.digests.reset(tokens, common_prefix_len(sess.tokens, tokens))
        sess.tokens = list(tokens)
        sess.hidden = sess.features = None

    # --- the model thread ------------------------------------------------------------------
    def _run_steps(self, steps: Sequence[_Step]) -> list:
        """One verification forward for every step that is ready -> per step its Verdict (or the
        exception that kept it out of the batch). A batch of Decode steps then takes its next forwards
        here while nothing else waits for the model thread and none of them is done (whose caller
        is answered at once: the others go on in the next batch)."""
        results = self._forward_steps(steps)
        while True:
            decodes = [i for i, st in enumerate(steps) if st.progress is not None and isinstance(results[i], Verdict)]
            for i in decodes:
                steps[i].progress.record(results[i])
                steps[i].position = None  # in sync from here on
            # Go on only while every step of the batch does: a finished one's caller gets its answer now.
            if (len(decodes) < len(steps) or any(steps[i].progress.done or steps[i].abandoned for i in decodes)
                    or self.batcher.others_waiting()):
                return results
            self.metrics.batch_size.observe(len(steps))
            results = self._forward_steps(steps)

    def _forward_steps(self, steps: Sequence[_Step]) -> list:
        """One verification forward for every step that is ready (see _run_steps)."""
        results: list = [None] * len(steps)
        ready: list[tuple[int, RowStep]] = []
        for i, st in enumerate(steps):
            try:
                if st.position is not None:
                    self._sync(st.session, st.position)
                ready.append((i, self._row_step(st)))
            except Exception as exc:  # noqa: BLE001 - one bad session must not fail the batch
                results[i] = exc
        for i, row in ready:
            results[i] = self._from_last_logits(steps[i], row)
        ready = [(i, row) for i, row in ready if results[i] is None]
        if not ready:
            return results
        sessions = [steps[i].session for i, _ in ready]
        # Hidden states only for a batch with a Decode step whose proposer reads them (Medusa
        # heads): a Verify never needs one (llama.cpp computes them at a cost), and a session that
        # moves from the draft to such a method takes one plain step first (_row_step).
        want_hidden = any(steps[i].proposer is not None and steps[i].proposer.needs_hidden for i, _ in ready)
        want_features = any(sess.features is not None for sess in sessions)  # (set by _row_step for EAGLE)
        outcomes, caches = verify_sessions(self.target, [s.cache for s in sessions], [r for _, r in ready],
                                           want_hidden=want_hidden, want_features=want_features,
                                           tap_layers=self._tap_layers(steps[i] for i, _ in ready))
        for (i, _), sess, out, cache in zip(ready, sessions, outcomes, caches):
            v = out.verdict
            sess.cache, sess.hidden = cache, out.hidden
            if sess.features is not None:
                sess.features.append(out.features)
            results[i] = self._took(steps[i], v)
        return results

    def _took(self, st: _Step, v: Verdict) -> Verdict:
        """A step's verdict into its session (model thread)."""
        st.session.tokens.extend(v.emitted)
        st.session.digests.extend(v.emitted)
        if st.proposer is not None:
            st.proposer.observe([v])
        self.metrics.record_verdict(v.num_drafted, v.num_accepted, len(v.emitted))
        return v

    def _from_last_logits(self, st: _Step, row: RowStep) -> Optional[Verdict]:
        """A session whose last load fed every committed token (last_logits): a plain step takes its
        token from those logits, with no forward (the load's was it, counted as this step's); any
        other step (a draft to verify, states to keep) drops that token from the cache again and
        feeds it as usual (-> None); except on llama.cpp (_from_load), where the step stays plain."""
        sess = st.session
        if sess.last_logits is None:
            return None
        from_load, (logits, sess.last_logits) = self._from_load(sess), (sess.last_logits, None)
        if (row.proposal.token_ids or row.proposal.aux is not None or sess.features is not None) and not from_load:
            sess.cache.truncate(torch.tensor([len(sess.tokens) - 1]))
            return None
        sess.hidden = None  # (the load kept no state: a proposer that reads it waits one plain step)
        verdict = Verdict(row_id=row.row_id, num_drafted=0, num_accepted=0,
                          emitted=(next_token(logits, row.sampling, row.generator),))
        return self._took(st, verdict)

    def _row_step(self, st: _Step) -> RowStep:
        """A session's row of the verification forward: the Verify's draft, or its Decode
        proposer's proposal (made here, right before the forward)."""
        sess = st.session
        reads_features = st.proposer is not None and st.proposer.needs_features
        if not reads_features:
            sess.features = None  # this step computes no features: a later EAGLE Decode reads the session again
        elif sess.features is None:
            self._read_features(sess, self._tap_layers([st]))
        # On llama.cpp the token after a load comes from the load's own logits (_from_last_logits):
        # that step drafts nothing (a Verify's draft is answered with that token alone, none judged).
        from_load = self._from_load(sess)
        proposal = Proposal() if from_load else Proposal(token_ids=st.draft_ids, draft_probs=st.draft_probs)
        # A proposer that reads the target's hidden state waits for one plain step when it is unknown;
        # one that reads features, when the session holds no position before its last token yet.
        if (st.proposer is not None and st.proposer_k > 0 and not (st.proposer.needs_hidden and sess.hidden is None)
                and not (reads_features and not sess.features) and not from_load):
            ctx = ProposeContext(row_ids=(SESSION_ROW,), token_ids=(tuple(sess.tokens),), k=(st.proposer_k,),
                                 sampling=st.sampling,
                                 target_hidden=(sess.hidden,) if st.proposer.needs_hidden else None,
                                 target_features=(torch.cat(sess.features),) if reads_features else None)
            if reads_features:
                sess.features = []  # handed over; the forward appends the positions it keeps
            [proposal] = st.proposer.propose(ctx)
        generator = make_generator(step_seed(st.sampling.seed, len(sess.tokens)))
        return RowStep(sess.tokens[-1], proposal, st.sampling, generator, row_id=SESSION_ROW)

    @staticmethod
    def _tap_layers(steps) -> tuple[int, ...]:
        """The target layers whose residuals the feature rows of these steps carry beside the
        features: those the first of their proposers that reads any asks for (one EAGLE draft a
        service; a draft without taps reads the features' columns only)."""
        return next((tuple(st.proposer.tap_layers) for st in steps
                     if st.proposer is not None and getattr(st.proposer, "tap_layers", ())), ())

    def _read_features(self, sess: TargetSession, tap_layers: Sequence[int] = ()) -> None:
        """Prefill the session's committed tokens again on a scratch cache, keeping the target's
        state at every position (with the residuals after tap_layers): what a feature-reading
        proposer (EAGLE) needs from position 0, when the session got here without them (its
        prefill, a Verify, another method; a prefix-cache hit carries no states). The session's
        own KV stays what its load and steps computed: on llama.cpp, whose kernels change with a
        forward's token count (specdec.prefix_cache), KV fed again in other forwards would part
        from plain decoding's at near-ties. The states of all its tokens but the last; of every
        one where its next step takes its token from its load's logits (_from_last_logits)."""
        n = len(sess.tokens) - (0 if self._from_load(sess) else 1)
        sess.features = []
        if n:
            scratch = self.target.new_cache(1)
            out = self.target.prefill(scratch, [sess.tokens[:n]], all_hidden=True, **tap_request(tap_layers))
            sess.features.append(feature_rows(out)[0, :n])

    def _from_load(self, sess: TargetSession) -> bool:
        """Whether the session's next step takes its token from its load's logits whatever it was
        asked to draft: on llama.cpp, where feeding that token again would change its KV and logits."""
        return sess.last_logits is not None and self.target.prefill_block > 1

    # --- RPC bodies ------------------------------------------------------------------------
    async def verify(self, session_id: str, pos: Position, draft_ids: Sequence[int],
                     draft_probs: Optional[torch.Tensor], sampling: SamplingParams,
                     draft_kind: Optional[DraftKind]) -> Verdict:
        """draft_kind None: the caller did not say (refused under sampling, see check_draft)."""
        if len(draft_ids) > self.settings.max_k:
            raise InvalidRequest(f"at most {self.settings.max_k} draft tokens per Verify, got {len(draft_ids)}")
        self._check_position(pos, len(draft_ids))
        ids = tuple(self._check_tokens(draft_ids, "draft token ids"))
        draft_probs = check_draft(draft_kind, len(ids), draft_probs, sampling)
        sess, new = self._named_session(session_id, pos)
        async with sess.lock:
            verdict = await self.batcher.submit(_Step(sess, pos, ids, draft_probs, sampling))
        if new:
            self._built(session_id)
        return verdict

    def local_method(self) -> str:
        """What Decode(method="auto") runs: the target-local method the measured verify cost of
        this model on this machine favours (costmodel.target_local_method, the rule `specdec
        generate --method auto` follows); measured once (kept in the cost store), at start-up."""
        if self._local_method is None:
            from specdec.costmodel import target_local_method

            method = target_local_method(self.costs.verify_cost(self.target),
                                         self.costs.acceptance(self.target, "prompt-lookup"))
            self._local_method = method if method == "plain" or method in self.methods else "plain"
        return self._local_method

    def verify_cost(self) -> dict[int, float]:
        """This target's measured verify cost v(k) here (the cost store's figure, measured once):
        Info hands it to the coordinator, whose auto weighs a draft's measured acceptance with it."""
        return self.costs.verify_cost(self.target)

    def drafting_cannot_pay(self) -> bool:
        """Whether no draft could pay on this target here (costmodel.speculation_can_pay on its
        measured verify cost, the figure local_method reads): the coordinator's auto then never
        tries the draft service. Worked out once (every Info call asks)."""
        if self._drafting_cannot_pay is None:
            from specdec.costmodel import speculation_can_pay

            self._drafting_cannot_pay = not speculation_can_pay(self.verify_cost())
        return self._drafting_cannot_pay

    def resolve_method(self, method: str) -> str:
        if method == "auto":
            return self.local_method()
        if not method:
            return next(m for m in FALLBACK_ORDER if m == "plain" or m in self.methods)
        if method != "plain" and method not in self.methods:
            raise InvalidRequest(f"unknown or unavailable decode method {method!r}; "
                                 f"available: {', '.join(self.available_methods())}")
        return method

    def available_methods(self) -> list[str]:
        return ["plain", *(m for m in self.methods if m != "plain")]

    async def decode(self, session_id: str, pos: Position, max_tokens: int, method: str,
                     sampling: SamplingParams, stop_token_ids: Sequence[int] = (), k: int = 4) -> DecodeResult:
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
        self._check_position(pos, max_tokens)
        if method == "auto" and self._local_method is None:  # measured once, on the model thread
            await self.batcher.run_alone(self.local_method)
        method = self.resolve_method(method)
        stop = StopConditions(max_tokens, tuple(int(t) for t in stop_token_ids))
        # History drafts where some session's tokens are kept, on plain decoding and beside prompt lookup
        # (what auto runs where a forward over a few tokens costs about one: its drafts where none matches)
        from_history = method in HISTORY_BESIDE and bool(self.history) and drafts_for(sampling)
        # (a history draft's length is the proposer's: the cost model's for its match, up to this k)
        progress = RowProgress(StopChecker(stop), KSchedule(k=min(MAX_DRAFT, self.settings.max_k) if from_history
                                                            else k))
        sess, new = self._named_session(session_id, pos)
        async with sess.lock:
            proposer = None
            if method != "plain":
                proposer = sess.proposers.get(method)
                if proposer is None:
                    proposer = sess.proposers[method] = await self.batcher.run_alone(self.methods[method])
            if from_history:  # the history's drafts first, the method's (if any) where it has none
                name = f"{HistoryProposer.name}+{method}"
                if name not in sess.proposers:
                    sess.proposers[name] = HistoryProposer(self.history, self.verify_cost(), self.history_acceptance,
                                                           fallback=proposer, fallback_k=k)
                proposer = sess.proposers[name]
            step = _Step(sess, pos, sampling=sampling, proposer=proposer, progress=progress)  # the first syncs
            try:
                while not progress.done:
                    await self.batcher.submit(step)  # takes one forward or more (_run_steps)
            except asyncio.CancelledError:
                step.abandoned = True
                raise
        if new:
            self._built(session_id)
        s = progress.stats
        return DecodeResult(tuple(progress.checker.generated), method, s.target_forwards, s.drafted, s.accepted)

    def tokenizer_files(self) -> dict[str, bytes]:
        if not self.tokenizer_dir:
            return {}
        root = Path(self.tokenizer_dir)
        return {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}

    async def close(self) -> None:
        await self.batcher.close()


def warm_up(target: CausalLM) -> None:
    """A short prefill and a few decoding steps on a throwaway cache, as llama-server does at
    load, before the service serves: the first request does not pay for what a first forward
    sets up (llama.cpp: its context, kept for the next cache; the compute buffers). Measured on
    the embedded GGUF, 2 threads: the first request's prefill took 560 ms against 220 for the
    next ones without it."""
    cache = target.new_cache(1)
    ids = [i % target.vocab_size for i in range(1, 9)]
    target.prefill(cache, [ids])
    for token in ids[:2]:
        target.forward(cache, torch.tensor([[token]]))


def _no_draft() -> CausalLM:
    raise FailedPrecondition("the target service runs no draft model")


def discover_methods(target: CausalLM, costs: Optional[CostStore] = None) -> dict[str, ProposerFactory]:
    """The registered methods that load here, with the target alone (drafts live in the draft
    service): prompt lookup and Lookahead, and Medusa when its heads load. costs: where their
    automatic choices read this machine's costs (default: the user's cache folder)."""
    from specdec.engine import EngineConfig

    env = ProposerEnv(target, EngineConfig(), costs if costs is not None else user_cost_store(),
                      load_draft=_no_draft, gives_features=True)
    found: dict[str, ProposerFactory] = {}
    for name in PROPOSERS:
        try:
            found[name] = load_proposer(name, env)
        except Exception as exc:  # noqa: BLE001 - a method that cannot load here is simply not offered
            log.info("decode method %s not available on this target: %s", name, str(exc).splitlines()[0][:200])
    return found
