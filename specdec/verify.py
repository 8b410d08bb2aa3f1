"""One verification step, the body of every decoding loop: score, accept, commit.

`verify_step` scores every row's block ([last committed token] + drafted nodes + aux inputs)
in one target forward, accepts by the request's rule, and keeps each row's root and accepted
path in the cache (the rest is rolled back). speculative_generate calls it on its batched
cache; the target service calls `verify_sessions`, which stacks the caches of sessions that
arrive together around the same call. So a session verified by the service gets exactly the
tokens the in-process loop would give it.

Invariant of a session's cache: it holds the KV of every committed token except the last one,
which is fed again as the *root* of the next block (the first block's root is the last prompt
token, so prefilling a prompt and rebuilding a session from its committed tokens are the same
operation: `load_committed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdec.acceptance import greedy_accept, rejection_sample, tree_rejection_sample, typical_accept
from specdec.backends.kv_cache import KVCache
from specdec.backends.kv_stack import split_cache, stack_caches
from specdec.backends.hf import CausalLM, feature_rows, tap_request
from specdec.sampling import logits_to_probs, next_token
from specdec.tree import block_mask, chain_parents, depths, greedy_walk
from specdec.types import Proposal, SamplingParams, Verdict


@dataclass(frozen=True)
class RowStep:
    """One row of a verification step."""

    root: int  # the row's last committed token
    proposal: Proposal
    sampling: SamplingParams
    generator: torch.Generator  # the row's own randomness (rejection sampling, the bonus token)
    # The row id the proposal was made under (ProposeContext.row_ids); the Verdict carries it
    # back, since a proposer's observe() finds its per-row state by that id, not by batch slot.
    row_id: int = 0


@dataclass(frozen=True)
class StepOutcome:
    verdict: Verdict  # row_id is the step's row_id
    hidden: Optional[torch.Tensor] = None  # [hidden] target state that produced the last emitted token
    # [1 + accepted, hidden] target states of the root and the accepted path (want_features):
    # the positions this step committed to the cache, in order.
    features: Optional[torch.Tensor] = None


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


def pack_blocks(blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' (ids, mask, depth) of different lengths -> one right-padded forward input."""
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


def _verdict(row: RowStep, path: Sequence[int], nxt: int, logits: torch.Tensor) -> Verdict:
    """logits [q, vocab]: the row's block; the aux inputs' logits travel back to the proposer."""
    prop = row.proposal
    n = len(prop.token_ids)
    m = len(prop.aux.token_ids) if prop.aux is not None else 0
    return Verdict(row_id=row.row_id, num_drafted=n, num_accepted=len(path),
                   emitted=tuple(prop.token_ids[p] for p in path) + (nxt,),
                   aux_logits=logits[n + 1 : n + 1 + m] if m else None)


def verify_step(target: CausalLM, cache: KVCache, rows: Sequence[RowStep],
                want_hidden: bool = False, want_features: bool = False,
                tap_layers: Sequence[int] = ()) -> list[StepOutcome]:
    """Score every row's block in one forward over `cache` (row i of the cache is rows[i]),
    accept, and keep each row's root and accepted path in the cache. want_hidden / want_features:
    each outcome also carries the target's state behind the last emitted token / the states of
    the positions kept (feature_rows: with the residuals after tap_layers, on a target that
    returns_taps)."""
    if all(not r.proposal.token_ids and r.proposal.aux is None for r in rows):
        return _plain_step(target, cache, rows, want_hidden, want_features, tap_layers)
    # 2. score: one target forward over every row's [root] + drafted nodes (+ aux inputs).
    ids, mask, depth, valid = pack_blocks([verify_block(r.proposal, r.root) for r in rows])
    out = target.forward(cache, ids, mask, depth, valid, want_hidden=want_hidden or want_features,
                         **tap_request(tap_layers if want_features else ()))
    states = feature_rows(out) if want_features else None
    logits = out.logits  # [rows, q, vocab]
    # 3. accept, 4. commit: keep the root and the accepted path in the cache, drop the rest.
    keep = torch.zeros_like(valid)  # [rows, q]
    outcomes = []
    for i, row in enumerate(rows):
        n = len(row.proposal.token_ids)
        path, nxt = accept_block(row.proposal, logits[i, : n + 1], row.sampling, row.generator)
        kept = [0] + [p + 1 for p in path]  # block columns of the root and the accepted path
        keep[i, kept] = True
        hidden = out.hidden[i, kept[-1]] if want_hidden else None
        features = states[i, kept] if want_features else None  # [1 + accepted, hidden (+ taps)]
        outcomes.append(StepOutcome(_verdict(row, path, nxt, logits[i]), hidden, features))
    cache.keep_last(keep)
    return outcomes


def _plain_step(target: CausalLM, cache: KVCache, rows: Sequence[RowStep], want_hidden: bool,
                want_features: bool, tap_layers: Sequence[int] = ()) -> list[StepOutcome]:
    """verify_step when no row drafted anything: one token per row, fed as a plain decoding step
    (no block mask or depths to build), its next token as the acceptance rule would pick it."""
    greedy_step = greedy_stepper(target, rows[0].sampling, len(rows), want_hidden or want_features)
    if greedy_step is not None:
        [row] = rows
        return [StepOutcome(Verdict(row_id=row.row_id, num_drafted=0, num_accepted=0,
                                    emitted=(greedy_step(cache, row.root),)), None, None)]
    ids = torch.tensor([[r.root] for r in rows], dtype=torch.long)  # [rows, 1]
    out = target.forward(cache, ids, want_hidden=want_hidden or want_features,
                         **tap_request(tap_layers if want_features else ()))
    states = feature_rows(out) if want_features else None
    outcomes = []
    for i, row in enumerate(rows):
        nxt = next_token(out.logits[i, 0], row.sampling, row.generator)
        verdict = Verdict(row_id=row.row_id, num_drafted=0, num_accepted=0, emitted=(nxt,))
        outcomes.append(StepOutcome(verdict, out.hidden[i, 0] if want_hidden else None,
                                    states[i, :1] if want_features else None))
    cache.keep_last(torch.ones(len(rows), 1, dtype=torch.bool))
    return outcomes


def greedy_stepper(target: CausalLM, sampling: SamplingParams, rows: int, want_states: bool = False):
    """The target's greedy_step(cache, token) -> next token, where it has one (llama.cpp) and the
    step is one greedy row with no hidden states asked for; else None (plain decoding's loop and
    _plain_step both ask here)."""
    if rows != 1 or want_states or not sampling.greedy:
        return None
    return target.greedy_step if target.greedy_steps else None


def verify_sessions(target: CausalLM, caches: Sequence[KVCache], rows: Sequence[RowStep],
                    want_hidden: bool = False, want_features: bool = False, tap_layers: Sequence[int] = ()
                    ) -> tuple[list[StepOutcome], list[KVCache]]:
    """verify_step for independent sessions, each with its own batch-1 cache (caches[i] for
    rows[i]), batched into one forward (on a target whose caches cannot be stacked, `stacks_caches`
    false, each session's step runs on its own cache, as the target's `run_each` spreads them).
    -> (outcomes, each session's cache after the step: the given one, updated in place, when
    alone; a new one when the caches had to be stacked). want_hidden / want_features / tap_layers: as
    verify_step."""
    if len(caches) == 1:
        return verify_step(target, caches[0], rows, want_hidden, want_features, tap_layers), list(caches)
    if not target.stacks_caches:  # llama.cpp: each session's own context, see run_each
        return _verify_side_by_side(target, caches, rows, want_hidden, want_features, tap_layers), list(caches)
    stacked = stack_caches(caches, target.new_cache)
    outcomes = verify_step(target, stacked, rows, want_hidden, want_features, tap_layers)
    return outcomes, split_cache(stacked, target.new_cache)


def _verify_side_by_side(target: CausalLM, caches: Sequence[KVCache], rows: Sequence[RowStep],
                         want_hidden: bool, want_features: bool, tap_layers: Sequence[int] = ()) -> list[StepOutcome]:
    """verify_sessions on a target whose caches are not stacked (llama.cpp): the one-token steps
    of sessions on one of its shared contexts joined into one forward a context (`join_caches`),
    those groups and every other session's step on its own cache side by side (`run_each`)."""
    plain = [i for i, r in enumerate(rows) if not r.proposal.token_ids and r.proposal.aux is None]
    join = getattr(target, "join_caches", None)
    groups = [(view, [plain[j] for j in idx]) for view, idx in (join([caches[i] for i in plain]) if join else [])]
    grouped = {i for _, idx in groups for i in idx}
    groups += [(caches[i], [i]) for i in range(len(rows)) if i not in grouped]

    def step(cache: KVCache, idx: list[int]) -> list[StepOutcome]:
        out = verify_step(target, cache, [rows[i] for i in idx], want_hidden, want_features, tap_layers)
        if len(idx) > 1:
            cache.split()  # (a joined view: each session's cache takes its row back)
        return out

    done = target.run_each([lambda c=c, idx=idx: step(c, idx) for c, idx in groups], [c for c, _ in groups])
    outcomes: list[Optional[StepOutcome]] = [None] * len(rows)
    for (_, idx), outs in zip(groups, done):
        for i, out in zip(idx, outs):
            outcomes[i] = out
    return outcomes


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share (lists or tuples), compared a slice at a time rather
    than a token at a time: called on a session's whole token list every step."""
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])
    if a == b:  # the usual case
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def load_committed(target: CausalLM, cache: KVCache, committed: Sequence[int],
                   cached: Optional[Sequence[int]] = None, through_last: bool = False) -> Optional[torch.Tensor]:
    """Make a batch-1 cache hold committed[:-1], keeping what it already holds correctly.

    cached: the tokens the cache's valid slots stand for, in order (a session's last committed
    tokens will do: the cache never holds more than those); only their common prefix with
    `committed` is kept. None: the cache's valid tokens are already a prefix of `committed`.
    through_last: where tokens must be fed, feed the last committed one too -> the logits [vocab]
    after it (the cache then holds every committed token; the next token comes from these logits
    with no forward of its own, as plain decoding takes its first token from the prompt's prefill);
    None where nothing was fed (the cache holds committed[:-1])."""
    have = int(cache.lengths[0])
    if cached is not None:
        have = min(have, common_prefix_len(cached, committed))
    want = len(committed) - 1
    if have != int(cache.lengths[0]) or have > want:
        cache.truncate(torch.tensor([min(have, want)]))
    if have < want and through_last:
        return target.prefill(cache, [list(committed[have:])]).logits[0].clone()  # (llama.cpp's buffer is reused)
    if have < want:
        target.prefill(cache, [list(committed[have:want])])
    return None
