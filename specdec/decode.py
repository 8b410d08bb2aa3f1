"""The reference loops: plain_generate() and speculative_generate().

Both take a batch of prompts of different lengths; in speculative decoding each row accepts
its own number of tokens per step (the validity-masked KV cache absorbs the difference).
Under greedy settings speculative_generate() emits exactly the tokens plain_generate() does,
for every proposer, k and batch size (up to float rounding between a k-token and a 1-token
forward, which can only matter where the target's top two logits tie).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from specdec.costmodel import best_k
from specdec.errors import InvalidRequest
from specdec.backends.hf import CausalLM, ForwardOutput, feature_rows, tap_request
from specdec.prefix_cache import PrefixCache, remember, restore_longest
from specdec.proposers.base import Proposer
from specdec.sampling import draft_seed, make_generator, next_token
from specdec.stopping import Detokenize, StopChecker
from specdec.types import (GenerationResult, GenerationStats, Proposal, ProposeContext, SamplingParams,
                           StopConditions, Verdict)
from specdec.verify import RowStep, greedy_stepper, verify_step


@dataclass(frozen=True)
class KSchedule:
    """How many tokens to draft.

    - fixed (default): always k;
    - adaptive: +2 after a fully accepted block, -1 after a block rejected in its first half
      (the transformers heuristic), within [k_min, k_max];
    - cost-aware (`verify_cost` given, see `cost_aware`): after every block, the k in
      [k_min, k_max] that maximizes E(alpha, k) / (k * draft_cost + v(k + 1)) for the row's
      running acceptance rate (Leviathan et al.'s speed-up formula, specdec.costmodel), starting
      from `prior_alpha`. On a CPU, whose verify cost jumps once a forward holds more than a few
      tokens, this keeps k small unless the draft is very good. k = 0 (a plain step) is chosen
      when drafting does not pay for itself; every `probe_every`-th step then drafts one token
      anyway, so the estimate can recover when the text turns predictable.
    """

    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 16
    verify_cost: Optional[tuple[tuple[int, float], ...]] = None  # ((m, v(m)), ...) of the target
    draft_cost: float = 0.0  # c: one drafted token / one target decode step
    prior_alpha: float = 0.5
    probe_every: int = 8

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidRequest(f"k must be >= 1, got {self.k}")
        lowest = 0 if self.verify_cost else 1  # the cost-aware schedule may choose plain steps
        if (self.adaptive or self.verify_cost) and not (lowest <= self.k_min <= self.k <= self.k_max):
            raise InvalidRequest(f"adaptive k needs {lowest} <= k_min <= k <= k_max, "
                                 f"got {self.k_min}, {self.k}, {self.k_max}")

    @classmethod
    def cost_aware(cls, verify_cost: dict[int, float], draft_cost: float, k_max: int = 8,
                   prior_alpha: float = 0.5) -> "KSchedule":
        curve = tuple(sorted(verify_cost.items()))
        first = best_k(prior_alpha, draft_cost, dict(curve), range(1, k_max + 1))
        return cls(k=first, k_min=0, k_max=k_max, verify_cost=curve, draft_cost=draft_cost, prior_alpha=prior_alpha)

    def next(self, k: int, drafted: int, accepted: int, hits: int = 0, trials: int = 0, step: int = 0) -> int:
        """k for a row's next block, after one that drafted `drafted` and accepted `accepted`;
        hits / trials: the row's drafted tokens accepted / judged so far (a judged token is one
        accepted or the first rejected of a block; those after it are never judged); step: the
        row's target forwards so far."""
        if self.verify_cost is not None:
            alpha = (hits + 4 * self.prior_alpha) / (trials + 4)
            choice = best_k(alpha, self.draft_cost, dict(self.verify_cost), range(self.k_min, self.k_max + 1))
            return 1 if choice == 0 and step % self.probe_every == 0 else choice
        if not self.adaptive or drafted == 0:
            return k
        if accepted == drafted:
            return min(k + 2, self.k_max)
        if accepted < drafted / 2:
            return max(k - 1, self.k_min)
        return k


def validate_request(target: CausalLM, prompts: Sequence[Sequence[int]], stop: StopConditions) -> None:
    if not prompts:
        raise InvalidRequest("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InvalidRequest(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < target.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt {i} has token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")
        if len(p) + stop.max_new_tokens > target.max_positions:
            raise InvalidRequest(
                f"prompt {i} ({len(p)} tokens) + max_new_tokens ({stop.max_new_tokens}) exceeds the model's "
                f"context of {target.max_positions} tokens")


def _row_generators(seed: Optional[int], batch: int) -> list[torch.Generator]:
    # Row b uses seed + b, so a row's samples do not depend on what else is in the batch.
    return [make_generator(None if seed is None else seed + b) for b in range(batch)]


OnEmit = Callable[[int, Sequence[int]], None]


@dataclass
class RowProgress:
    """One sequence's bookkeeping beside a decoding loop: its generated tokens and stop (the
    checker), its counters, and the k of its next block (from the schedule and the row's running
    acceptance). The loops here keep one per row; the target service's Decode one per call."""

    checker: StopChecker
    schedule: KSchedule = KSchedule()
    prompt: tuple[int, ...] = ()
    stats: GenerationStats = field(default_factory=GenerationStats)
    hits: int = 0  # drafted tokens accepted so far
    trials: int = 0  # drafted tokens judged so far: accepted ones, and the first rejected of each block
    k: int = field(init=False)

    def __post_init__(self) -> None:
        self.k = self.schedule.k

    @property
    def done(self) -> bool:
        return self.checker.finish_reason is not None

    @property
    def committed(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.checker.generated)

    @property
    def last_token(self) -> int:
        return self.checker.generated[-1] if self.checker.generated else self.prompt[-1]

    def block_k(self) -> int:
        """Tokens to draft next: never more than still allowed (a block's bonus is one more)."""
        return min(self.k, self.checker.remaining - 1)

    def record(self, verdict: Verdict) -> list[int]:
        """Count one target forward; take its emitted tokens up to the stop -> the tokens taken."""
        taken = self.checker.push(verdict.emitted)
        drafted, accepted = verdict.num_drafted, verdict.num_accepted
        s = self.stats
        s.target_forwards += 1
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += len(taken)
        self.hits += accepted
        self.trials += accepted + (1 if accepted < drafted else 0)
        self.k = self.schedule.next(self.k, drafted, accepted, self.hits, self.trials, s.target_forwards)
        return taken


def _record(rows: Sequence[RowProgress], verdict: Verdict, on_emit: Optional[OnEmit]) -> None:
    """Commit a row's verdict; tell on_emit (row, tokens) what was taken."""
    taken = rows[verdict.row_id].record(verdict)
    if on_emit is not None and taken:
        on_emit(verdict.row_id, taken)


def _record_token(rows: Sequence[RowProgress], row: int, token: int, on_emit: Optional[OnEmit]) -> None:
    """A plain step's token: one forward, nothing drafted."""
    _record(rows, Verdict(row_id=row, num_drafted=0, num_accepted=0, emitted=(token,)), on_emit)


def _drop_finished(cache, active: list[int], rows: Sequence[RowProgress], t0: float) -> list[int]:
    """The rows of `active` still decoding; finished rows get their time and leave the cache."""
    alive = [i for i, b in enumerate(active) if not rows[b].done]
    for b in active:
        if rows[b].done and rows[b].stats.elapsed_s == 0.0:
            rows[b].stats.elapsed_s = time.perf_counter() - t0
    if alive and len(alive) < len(active):
        cache.select_rows(torch.tensor(alive, dtype=torch.long))
    return [active[i] for i in alive]


def _prompt_states(first: ForwardOutput, lens: Sequence[int], want_hidden: bool,
                   want_features: bool) -> tuple[list, list[list[torch.Tensor]]]:
    """A prefill's hidden states ([batch, hidden] at each row's last token, or [batch, width,
    hidden] at every position with want_features, with its taps where asked) -> per row: the
    state behind its last token (None unless want_hidden), and its prompt positions' states
    ([[len, hidden (+ taps)]]: feature_rows; [] unless want_features)."""
    hidden = first.hidden
    if not want_features:
        return (list(hidden) if want_hidden else [None] * len(lens)), [[] for _ in lens]
    last = [hidden[b, n - 1] for b, n in enumerate(lens)] if want_hidden else [None] * len(lens)
    states = feature_rows(first)
    return last, [[states[b, :n]] for b, n in enumerate(lens)]


def _prefill(target: CausalLM, prompts: Sequence[Sequence[int]], prefix_cache: Optional[PrefixCache],
             want_hidden: bool = False, all_hidden: bool = False, tap_layers: Sequence[int] = ()):
    """A new cache with the prompts in it -> (cache, the prefill's ForwardOutput). One prompt
    with a prefix cache: starts from the longest cached prefix of the prompt (all but its last
    token at most) and prefills the rest, then keeps the prompt's KV there (a shared system
    prompt, a conversation's next turn). Not with all_hidden: a restored prefix has no features.
    tap_layers (with all_hidden): the residuals after those layers too (ForwardOutput.taps)."""
    if prefix_cache is None or len(prompts) != 1 or all_hidden:
        cache = target.new_cache(len(prompts))
        return cache, target.prefill(cache, [list(p) for p in prompts], want_hidden=want_hidden, all_hidden=all_hidden,
                                     **tap_request(tap_layers if all_hidden else ()))
    prompt = list(prompts[0])
    n, cache = restore_longest(prefix_cache, target, prompt, at_most=len(prompt) - 1)
    cache = cache if cache is not None else target.new_cache(1)
    first = target.prefill(cache, [prompt[n:]], want_hidden=want_hidden)
    remember(prefix_cache, target, cache, prompt)
    return cache, first


def _keep_finished(prefix_cache: Optional[PrefixCache], target: CausalLM, cache, rows: Sequence[RowProgress]) -> None:
    """One sequence done: keep the KV of its prompt and answer (all but the last token, the one
    never fed; on llama.cpp its prompt's whole blocks: specdec.prefix_cache) in the prefix cache,
    for a conversation's next turn."""
    if prefix_cache is None or len(rows) != 1:
        return
    tokens = rows[0].committed[:-1]
    if cache.batch_size == 1 and int(cache.lengths[0]) == len(tokens):
        remember(prefix_cache, target, cache, tokens, prefilled=len(rows[0].prompt))


def _finish(rows: Sequence[RowProgress]) -> list[GenerationResult]:
    return [GenerationResult(tuple(r.checker.generated), r.checker.finish_reason or "length", r.stats) for r in rows]


def plain_generate(
    target: CausalLM,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams = SamplingParams(),
    stop: StopConditions = StopConditions(),
    detokenize: Optional[Detokenize] = None,
    on_emit: Optional[OnEmit] = None,
    prefix_cache: Optional[PrefixCache] = None,
) -> list[GenerationResult]:
    """One target forward per token: the baseline every other method must reproduce.
    on_emit(row, tokens) is called with each row's tokens as they are committed (streaming);
    prefix_cache: KV of earlier prompts and answers, reused and added to (see _prefill)."""
    validate_request(target, prompts, stop)
    t0 = time.perf_counter()
    gens = _row_generators(sampling.seed, len(prompts))
    rows = [RowProgress(StopChecker(stop, detokenize), prompt=tuple(p)) for p in prompts]
    cache, first = _prefill(target, prompts, prefix_cache)
    greedy_step = greedy_stepper(target, sampling, len(prompts))  # (llama.cpp: no logits copied out)
    nxt = [next_token(row_logits, sampling, gens[b]) for b, row_logits in enumerate(first.logits)]
    active = list(range(len(prompts)))  # row index of each cache row
    while active:
        for b, token in zip(active, nxt):
            _record_token(rows, b, token, on_emit)
        active = _drop_finished(cache, active, rows, t0)
        if active and greedy_step is not None:
            nxt = [greedy_step(cache, rows[active[0]].last_token)]
        elif active:
            last = torch.tensor([rows[b].last_token for b in active])  # [rows]
            logits = target.forward(cache, last[:, None]).logits[:, -1]  # [rows, vocab]
            nxt = [next_token(logits[i], sampling, gens[b]) for i, b in enumerate(active)]
    _keep_finished(prefix_cache, target, cache, rows)
    return _finish(rows)


def speculative_generate(
    target: CausalLM,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams = SamplingParams(),
    stop: StopConditions = StopConditions(),
    k: KSchedule | int = 4,
    detokenize: Optional[Detokenize] = None,
    on_emit: Optional[OnEmit] = None,
    prefix_cache: Optional[PrefixCache] = None,
) -> list[GenerationResult]:
    """Speculative decoding: propose, score in one target forward, accept, commit / roll back, observe.
    on_emit(row, tokens) is called with each row's tokens as they are committed (streaming);
    prefix_cache: as in plain_generate.

    Each row draws from its own generators (the target's: seed + row; the draft's: a salted
    seed + row), so a seeded row's output does not depend on the rows that share its batch."""
    validate_request(target, prompts, stop)
    t0 = time.perf_counter()
    schedule = k if isinstance(k, KSchedule) else KSchedule(k=k)
    rows = [RowProgress(StopChecker(stop, detokenize), schedule, tuple(p)) for p in prompts]
    target_gens = _row_generators(sampling.seed, len(prompts))
    draft_gens = _row_generators(draft_seed(sampling.seed), len(prompts))
    want_hidden = proposer.needs_hidden
    want_features = getattr(proposer, "needs_features", False)  # a proposer need not subclass Proposer
    tap_layers = getattr(proposer, "tap_layers", ())  # the target layers whose residuals it reads beside the features
    # 0. prefill: a target forward that emits one token, exactly as in plain decoding.
    cache, first = _prefill(target, prompts, prefix_cache, want_hidden, all_hidden=want_features, tap_layers=tap_layers)
    hidden, features = _prompt_states(first, [len(p) for p in prompts], want_hidden, want_features)
    for b, row_logits in enumerate(first.logits):
        _record_token(rows, b, next_token(row_logits, sampling, target_gens[b]), on_emit)
    active = _drop_finished(cache, list(range(len(prompts))), rows, t0)
    while active:
        # 1. propose, at most each row's block_k tokens (0: a plain step for that row).
        ctx = ProposeContext(row_ids=tuple(active), token_ids=tuple(rows[b].committed for b in active),
                             k=tuple(rows[b].block_k() for b in active), sampling=sampling,
                             target_hidden=tuple(hidden[b] for b in active) if want_hidden else None,
                             target_features=(tuple(torch.cat(features[b]) for b in active) if want_features
                                              else None),
                             generators=tuple(draft_gens[b] for b in active))
        proposed = any(ctx.k)
        t_propose = time.perf_counter()
        proposals = proposer.propose(ctx) if proposed else [Proposal() for _ in active]
        t_propose = time.perf_counter() - t_propose
        for b in active:
            rows[b].stats.draft_s += t_propose
        # 2. score, 3. accept, 4. commit / roll back: one target forward for every row.
        steps = [RowStep(rows[b].last_token, prop, sampling, target_gens[b], row_id=b)
                 for b, prop in zip(active, proposals)]
        outcomes = verify_step(target, cache, steps, want_hidden, want_features, tap_layers)
        for out in outcomes:
            b = out.verdict.row_id
            _record(rows, out.verdict, on_emit)
            hidden[b] = out.hidden
            if want_features:  # kept until a propose() call has been handed them
                features[b] = ([] if proposed else features[b]) + [out.features]
        # 5. observe.
        proposer.observe([out.verdict for out in outcomes])
        active = _drop_finished(cache, active, rows, t0)
    _keep_finished(prefix_cache, target, cache, rows)
    return _finish(rows)
