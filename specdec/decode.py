"""The reference loops: plain_generate() and speculative_generate().

Both take a batch of prompts of different lengths; in speculative decoding each row accepts
its own number of tokens per step (the validity-masked KV cache absorbs the difference).
Under greedy settings speculative_generate() emits exactly the tokens plain_generate() does,
for every proposer, k and batch size (up to float rounding between a k-token and a 1-token
forward, which can only matter where the target's top two logits tie).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from specdec.acceptance import greedy_accept, rejection_sample, tree_rejection_sample, typical_accept
from specdec.costmodel import best_k
from specdec.errors import InvalidRequest
from specdec.lm import CausalLM
from specdec.proposers.base import Proposer
from specdec.sampling import logits_to_probs, make_generator, next_token
from specdec.stopping import Detokenize, StopChecker
from specdec.tree import block_mask, chain_parents, depths, greedy_walk
from specdec.types import (GenerationResult, GenerationStats, Proposal, ProposeContext, SamplingParams,
                           StopConditions, Verdict)


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


def _row_generators(sampling: SamplingParams, batch: int) -> list[torch.Generator]:
    # Row b uses seed + b, so a row's samples do not depend on what else is in the batch.
    return [make_generator(None if sampling.seed is None else sampling.seed + b) for b in range(batch)]


OnEmit = Callable[[int, Sequence[int]], None]


def _commit(checker: StopChecker, tokens: Sequence[int], row: int, on_emit: Optional[OnEmit]) -> list[int]:
    """Append a row's emitted tokens up to its stop; tell on_emit what was taken."""
    taken = checker.push(tokens)
    if on_emit is not None and taken:
        on_emit(row, taken)
    return taken


def _finish(checkers: Sequence[StopChecker], stats: Sequence[GenerationStats]) -> list[GenerationResult]:
    return [GenerationResult(tuple(c.generated), c.finish_reason or "length", s) for c, s in zip(checkers, stats)]


def plain_generate(
    target: CausalLM,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams = SamplingParams(),
    stop: StopConditions = StopConditions(),
    detokenize: Optional[Detokenize] = None,
    on_emit: Optional[OnEmit] = None,
) -> list[GenerationResult]:
    """One target forward per token: the baseline every other method must reproduce.
    on_emit(row, tokens) is called with each row's tokens as they are committed (streaming)."""
    validate_request(target, prompts, stop)
    t0 = time.perf_counter()
    batch = len(prompts)
    gens = _row_generators(sampling, batch)
    checkers = [StopChecker(stop, detokenize) for _ in range(batch)]
    stats = [GenerationStats() for _ in range(batch)]
    cache = target.new_cache(batch)
    logits = target.prefill(cache, [list(p) for p in prompts]).logits  # [batch, vocab]
    active = list(range(batch))  # row index of each cache row
    while True:
        toks = []
        for i, b in enumerate(active):
            tok = next_token(logits[i], sampling, gens[b])
            _commit(checkers[b], [tok], b, on_emit)
            stats[b].target_forwards += 1
            stats[b].emitted += 1
            toks.append(tok)
        alive = [i for i, b in enumerate(active) if checkers[b].finish_reason is None]
        for i, b in enumerate(active):
            if i not in alive:
                stats[b].elapsed_s = time.perf_counter() - t0
        if not alive:
            return _finish(checkers, stats)
        if len(alive) < len(active):
            cache.select_rows(torch.tensor(alive))
            active = [active[i] for i in alive]
            toks = [toks[i] for i in alive]
        logits = target.forward(cache, torch.tensor(toks)[:, None]).logits[:, -1]


def verify_block(proposal: Proposal, root: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Block inputs for one row: [root] + drafted nodes (+ aux inputs), its [q, q] mask and [q] depths."""
    parents = proposal.parents if proposal.parents is not None else chain_parents(len(proposal.token_ids))
    ids, mask, depth = [root, *proposal.token_ids], block_mask(parents), depths(parents)
    if proposal.aux is None:
        return ids, mask, depth
    aux = proposal.aux
    n1, m = len(ids), len(aux.token_ids)
    full = torch.zeros(n1 + m, n1 + m, dtype=torch.bool)  # candidates never see aux inputs
    full[:n1, :n1] = mask
    full[n1:] = aux.mask
    return ids + list(aux.token_ids), full, torch.cat([depth, torch.tensor(aux.depth, dtype=torch.long)])


def accept_block(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams,
            gen: torch.Generator) -> tuple[list[int], int]:
    """logits [n + 1, vocab] for one row's block -> (accepted node indices, next token)."""
    n = len(proposal.token_ids)
    if sampling.greedy:
        if proposal.is_chain:
            accepted, nxt = greedy_accept(torch.tensor(proposal.token_ids, dtype=torch.long), logits)
            return list(range(accepted)), nxt
        return greedy_walk(proposal.token_ids, proposal.parents, logits.argmax(-1).tolist())
    if n == 0:
        return [], next_token(logits[0], sampling, gen)
    target_probs = logits_to_probs(logits, sampling)  # [n + 1, vocab]
    parents = proposal.parents if proposal.parents is not None else chain_parents(n)
    if sampling.typical is not None:  # lossy, opt-in
        t = sampling.typical
        return typical_accept(proposal.token_ids, parents, target_probs, gen, t.posterior_threshold, t.posterior_alpha)
    if not proposal.is_chain:  # trees are deterministic drafts (Proposal forbids draft_probs on them)
        return tree_rejection_sample(proposal.token_ids, proposal.parents, target_probs, gen)
    accepted, nxt = rejection_sample(torch.tensor(proposal.token_ids, dtype=torch.long), proposal.draft_probs,
                                     target_probs, gen)
    return list(range(accepted)), nxt


def speculative_generate(
    target: CausalLM,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams = SamplingParams(),
    stop: StopConditions = StopConditions(),
    k: KSchedule | int = 4,
    detokenize: Optional[Detokenize] = None,
    on_emit: Optional[OnEmit] = None,
) -> list[GenerationResult]:
    """Speculative decoding: propose, score in one target forward, accept, commit / roll back, observe.
    on_emit(row, tokens) is called with each row's tokens as they are committed (streaming)."""
    schedule = k if isinstance(k, KSchedule) else KSchedule(k=k)
    validate_request(target, prompts, stop)
    t0 = time.perf_counter()
    batch = len(prompts)
    gens = _row_generators(sampling, batch)
    checkers = [StopChecker(stop, detokenize) for _ in range(batch)]
    stats = [GenerationStats(target_forwards=1, emitted=1) for _ in range(batch)]
    row_k = [schedule.k] * batch
    hits, trials = [0] * batch, [0] * batch  # per row: drafted tokens accepted / judged (for the schedule)
    needs_hidden = bool(getattr(proposer, "needs_hidden", False))
    cache = target.new_cache(batch)
    # The prefill is a target forward that emits one token, exactly as in plain decoding.
    first = target.prefill(cache, [list(p) for p in prompts], want_hidden=needs_hidden)
    hidden = list(first.hidden) if needs_hidden else None  # per row [hidden]: state that produced the last token
    committed = [list(p) for p in prompts]
    for b in range(batch):
        committed[b] += _commit(checkers[b], [next_token(first.logits[b], sampling, gens[b])], b, on_emit)
    active = [b for b in range(batch) if checkers[b].finish_reason is None]
    if len(active) < batch:
        cache.select_rows(torch.tensor(active, dtype=torch.long))
    while active:
        # 1. propose: never more than the tokens still allowed (the block's bonus is one more).
        ks = tuple(min(row_k[b], checkers[b].remaining - 1) for b in active)
        ctx = ProposeContext(row_ids=tuple(active), token_ids=tuple(tuple(committed[b]) for b in active), k=ks,
                             sampling=sampling,
                             target_hidden=tuple(hidden[b] for b in active) if needs_hidden else None)
        proposals = proposer.propose(ctx) if any(ks) else [Proposal() for _ in active]
        # 2. score: one target forward over every row's [last committed token] + drafted nodes.
        blocks = [verify_block(p, committed[b][-1]) for p, b in zip(proposals, active)]
        q = max(len(ids) for ids, _, _ in blocks)
        ids = torch.zeros(len(active), q, dtype=torch.long)
        mask = torch.zeros(len(active), q, q, dtype=torch.bool)
        depth = torch.zeros(len(active), q, dtype=torch.long)
        valid = torch.zeros(len(active), q, dtype=torch.bool)
        for i, (row_ids, row_mask, row_depth) in enumerate(blocks):
            n = len(row_ids)
            ids[i, :n] = torch.tensor(row_ids)
            mask[i, :n, :n] = row_mask
            depth[i, :n] = row_depth
            valid[i, :n] = True
        out = target.forward(cache, ids, mask, depth, valid, want_hidden=needs_hidden)
        logits = out.logits  # [rows, q, vocab]
        # 3. accept, 4. commit: keep the root and the accepted path in the cache, drop the rest.
        keep = torch.zeros(len(active), q, dtype=torch.bool)
        verdicts = []
        for i, (b, prop) in enumerate(zip(active, proposals)):
            n = len(prop.token_ids)
            path, nxt = accept_block(prop, logits[i, : n + 1], sampling, gens[b])
            keep[i, 0] = True
            keep[i, [p + 1 for p in path]] = True
            if needs_hidden:
                hidden[b] = out.hidden[i, path[-1] + 1 if path else 0]
            emitted = [prop.token_ids[p] for p in path] + [nxt]
            m = len(prop.aux.token_ids) if prop.aux is not None else 0
            verdicts.append(Verdict(row_id=b, num_drafted=n, num_accepted=len(path), emitted=tuple(emitted),
                                    aux_logits=logits[i, n + 1 : n + 1 + m] if m else None))
            taken = _commit(checkers[b], emitted, b, on_emit)
            committed[b] += taken
            s = stats[b]
            s.target_forwards += 1
            s.drafted += n
            s.accepted += len(path)
            s.emitted += len(taken)
            hits[b] += len(path)
            trials[b] += len(path) + (1 if len(path) < n else 0)
            row_k[b] = schedule.next(row_k[b], n, len(path), hits[b], trials[b], s.target_forwards)
        cache.keep_last(keep)
        # 5. observe.
        proposer.observe(verdicts)
        alive = [i for i, b in enumerate(active) if checkers[b].finish_reason is None]
        for i, b in enumerate(active):
            if i not in alive:
                stats[b].elapsed_s = time.perf_counter() - t0
        if len(alive) < len(active):
            active = [active[i] for i in alive]
            if active:
                cache.select_rows(torch.tensor(alive, dtype=torch.long))
    for b in range(batch):
        if stats[b].elapsed_s == 0.0:
            stats[b].elapsed_s = time.perf_counter() - t0
    return _finish(checkers, stats)
