"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iteration plus an n-gram pool; no draft
model, no training. Lossless under greedy decoding (the default) and under sampling.

Each step rides on the target's ordinary verification forward, in one block:

    [root] + verification branch (candidate nodes) + lookahead branch (aux inputs)

- **Lookahead branch** (an `AuxBlock`): a window of `h <= N - 1` levels x W columns of guessed
  tokens. Level j, column i sits at position root + i + j. Level 0 is a causal chain whose
  column 0 *is* the root (the last committed token, already in the block), so the branch has
  W * h - 1 aux inputs. Token (j, i) attends to the root, level-0 columns 1..i and its own
  column at levels 1..j: a run of consecutive positions, so its logits are the target's guess
  for position root + i + j + 1 given that run. The top level's guesses are one Jacobi step.
- **n-grams**: once the window has N - 1 levels, column i plus its top-level guess is an
  N-gram (L0[i], L1[i], ..., L_{N-2}[i], guess[i]); all W of them go into the pool each step.
  The pool (`specdec.ngram_pool.NgramPool`) files continuations under their first token, at most
  G per key, newest kept.
- **Verification branch**: up to G pool continuations of the root token, each cut to
  min(N - 1, k) tokens, merged into a trie (shared prefixes share nodes) and checked by the
  ordinary greedy tree walk. Candidates never attend to aux inputs, so the output is exactly
  plain greedy decoding's. Under sampling the loop verifies the same trie with SpecInfer's
  multi-candidate rejection sampling for deterministic drafts (`tree_rejection_sample`): the
  guesses are a function of the committed tokens only and siblings carry distinct tokens, so
  every emitted token is an exact sample of the target (the window itself always advances by
  argmax, as in the reference; that only changes which guesses are made).
- **Window update** (after each forward, `observe`): stack the levels and the new guesses
  (h + 1 levels) and drop the oldest level once there are more than N - 1 (the Jacobi step),
  then shift all columns left by `s` and refill the s freed columns on the right with tokens
  drawn from the sequence's own context (the reference's initialisation; when s >= W the
  window restarts from one level). s treats every step as a one-token advance, as the
  reference implementation does: when a guesses were accepted (the root moved a + 1
  positions) the window's guesses end up a positions off. Shifting by the whole advance
  instead (every kept token at the position it was computed for, a columns refilled) measured
  worse on the real target (chat + code, 4 prompts x 64 tokens, tau): W,N,G=4,3,2: 1.27 vs
  1.25; 5,4,2: 1.40 vs 1.34. The pool is keyed by tokens, not positions, so a slightly
  misplaced window still yields good n-grams, while refilled columns yield none for N - 2 steps.
- **Warm-up**: a fresh window is one level (root + W - 1 context tokens); it grows one level
  per step until it has N - 1, and only then yields n-grams. With `pool_from_context` (default
  on; W,N,G=4,3,2, chat + code: tau 1.25 with it, 1.19 without) the pool is also seeded with the n-grams of the prompt and of every
  committed token, under the same insertion rule: this makes the verification branch useful
  from the first step and on repetitive text (code, summaries), like prompt lookup.

Cost, and a rule for choosing W, N, G. A step feeds q = 1 + c + (W * (N - 1) - 1) inputs,
c <= G * (N - 1) candidate nodes (fewer when guesses share prefixes), costs v(q) plain steps
and emits tau tokens, so tokens/s over plain is tau / v(q). Rule: choose the (W, N, G) that
maximises tau / v(q), with v measured on the machine that serves (`specdec/bench/lookahead_tune.py`,
or `specdec.costmodel.measure_verify_cost`) and tau from a few prompts of the workload (tau
needs no quiet machine: `--tau-only`). What moves tau: N (an accepted guess is worth up to
N - 1 tokens; N - 1 must not exceed the loop's `k`, which caps the guess depth), then W (how
many n-grams a step makes), then G (beyond 2 guesses hits barely grow). On a GPU v(q) is ~1
into the hundreds, hence the published 15, 5, 15 with G = W. On this 2-core CPU v grows from
the first extra input (SmolLM2-135M, 1 thread, CPU time, 200-token context; transformers
backend: v(4) 1.4, v(8) 1.7, v(10) 1.9, v(16) 2.0, v(20) 2.3; the leaner `fast` backend, whose
1-token step is 1.7x cheaper: v(2) 1.1, v(4) 1.5, v(8) 2.4, v(12) 2.9, v(20) 4.0), while tau
over W 2..5, N 3..4, G 1..4 only spans 1.15-1.45 on chat and code. No setting tried beats plain
decoding here: tau / v is 0.7-0.85 on the transformers backend, where the defaults W=4, N=3,
G=2 (q ~ 10) measured best (0.81x plain on chat, 0.80x on code, CPU time), and 0.5-0.7 on
`fast`, where the smallest window measured best (W=2, N=3, G=1, q ~ 5: 0.68x chat, 0.71x
code; pass --window 2 --guess 1). Why it cannot win on a CPU like this one: each extra input
costs ~2 x params FLOPs (measured ~6 ms per input on one core, ~45 GFLOP/s), while a step can at
best cost 4 x params bytes at ~28 GB/s; with both cores that is v(q) >= 1 + 0.15 (q - 1) in fp32
for any model size (0.15 = bandwidth / (2 x FLOP/s)), so a window worth having (q >= 5) needs
tau >= 1.6 just to break even and >= 2.1 for 1.3x. Lookahead pays where v stays
near 1 for q ~ 10-30: a GPU, or a CPU with several times more FLOP/s per byte of bandwidth.

Known limitations: under sampling, guesses are argmax n-grams, so acceptance drops as the
temperature rises; the pool is per sequence (not shared across requests); lower window levels'
logits are computed though only the top level's are used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specdec.errors import InvalidRequest
from specdec.ngram_pool import NgramPool
from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.types import AuxBlock, Proposal, ProposeContext, Verdict


@dataclass(frozen=True)
class LookaheadConfig:
    window: int = 4  # W: columns of the Jacobi window (new n-grams per step)
    ngram: int = 3  # N: n-gram size; guesses are N - 1 tokens long, the window has N - 1 levels
    guess: int = 2  # G: pool continuations verified per step (also the pool's bound per key)
    pool_from_context: bool = True  # also pool the n-grams of the prompt and committed tokens
    max_keys: int = 4096  # the pool's bound on distinct first tokens
    seed: int = 0  # for the context tokens that (re)fill the window; any value is lossless

    def __post_init__(self) -> None:
        if self.window < 1:
            raise InvalidRequest(f"lookahead window W must be >= 1, got {self.window}")
        if self.ngram < 2:
            raise InvalidRequest(f"lookahead n-gram size N must be >= 2, got {self.ngram}")
        if self.guess < 1:
            raise InvalidRequest(f"lookahead guess-set size G must be >= 1, got {self.guess}")
        if self.max_keys < 1:
            raise InvalidRequest(f"lookahead pool max_keys must be >= 1, got {self.max_keys}")


# --- pure builders ---------------------------------------------------------------------------


def window_cells(window: int, levels: int) -> list[tuple[int, int]]:
    """(level, column) of each aux input, in block order: level 0 columns 1..W-1 (column 0 is
    the root), then each higher level's columns 0..W-1."""
    return [(0, i) for i in range(1, window)] + [(j, i) for j in range(1, levels) for i in range(window)]


def window_mask(window: int, levels: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The lookahead branch's attention pattern: mask [m, 1 + m] bool (column 0 is the root,
    then the m aux inputs in `window_cells` order) and depth [m] (position offset from the
    root: level + column)."""
    cells = window_cells(window, levels)
    index = {cell: a for a, cell in enumerate(cells)}
    mask = torch.zeros(len(cells), 1 + len(cells), dtype=torch.bool)
    for a, (j, i) in enumerate(cells):
        mask[a, 0] = True  # the root
        for c in range(1, i + 1):  # the level-0 chain up to this column
            mask[a, 1 + index[(0, c)]] = True
        for lv in range(1, j + 1):  # this column at levels 1..j (itself included)
            mask[a, 1 + index[(lv, i)]] = True
    return mask, tuple(j + i for j, i in cells)


def build_trie(guesses: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token sequences -> (token_ids, parents) of their prefix trie under the root; nodes in
    insertion order, so every parent precedes its children. Duplicates and prefixes of earlier
    guesses add no nodes."""
    token_ids: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for guess in guesses:
        node = -1
        for tok in guess:
            nxt = children.get((node, int(tok)))
            if nxt is None:
                nxt = children[(node, int(tok))] = len(token_ids)
                token_ids.append(int(tok))
                parents.append(node)
            node = nxt
    return tuple(token_ids), tuple(parents)


def window_ngrams(levels: Sequence[Sequence[int]], top_guess: Sequence[int], root: int) -> list[tuple[int, ...]]:
    """The W n-grams of a full window: column i read bottom-up, then its top-level guess.
    levels[0][0] stands for the root (passed separately, the stored value is a placeholder)."""
    out = []
    for i, guess in enumerate(top_guess):
        col = [root if i == 0 else levels[0][i]] + [lv[i] for lv in levels[1:]]
        out.append(tuple(col) + (int(guess),))
    return out


def advance_window(levels: Sequence[Sequence[int]], top_guess: Sequence[int], advance: int, max_levels: int,
                   refill) -> list[list[int]]:
    """The window after the root moved `advance` (>= 1) positions, every kept token staying at
    the position it was computed for. The new guesses become the top level; the oldest level
    is dropped if there are more than max_levels; the remaining advance shifts columns left,
    and refill() supplies each freed cell. Returns a one-level window of refill() tokens when
    every column would be freed."""
    window = len(top_guess)
    stack = [list(lv) for lv in levels] + [list(top_guess)]
    drop = 1 if len(stack) > max_levels else 0
    shift = advance - drop
    if shift >= window:
        return [[refill() for _ in range(window)]]
    return [lv[shift:] + [refill() for _ in range(shift)] for lv in stack[drop:]]


# --- the proposer ----------------------------------------------------------------------------


@dataclass
class _Row:
    pool: NgramPool
    levels: list[list[int]]  # [h, W]; levels[0][0] is a placeholder for the root
    rng: random.Random
    context: tuple[int, ...]  # committed tokens at the last propose
    pooled_upto: int = 0  # context n-grams starting before this index are in the pool
    pending_levels: Optional[int] = None  # h of the window in flight (None: no window proposed)


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self, config: Optional[LookaheadConfig] = None, **overrides):
        base = config if config is not None else LookaheadConfig()
        self.config = LookaheadConfig(**{**base.__dict__, **overrides}) if overrides else base
        self._rows: dict[int, _Row] = {}

    # The loop calls propose once per step with every active row, then observe with the verdicts.

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        return [self._propose_row(rid, tuple(toks), k) for rid, toks, k in zip(ctx.row_ids, ctx.token_ids, ctx.k)]

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:
            row = self._rows.get(v.row_id)
            if row is None or row.pending_levels is None:
                continue
            self._advance_row(row, v)

    # ---

    def _row_for(self, row_id: int, toks: tuple[int, ...]) -> _Row:
        cfg = self.config
        row = self._rows.get(row_id)
        if row is None or toks[: len(row.context)] != row.context:  # a new sequence under this id
            rng = random.Random(cfg.seed * 1_000_003 + row_id)
            row = _Row(pool=NgramPool(cfg.ngram, cfg.guess, cfg.max_keys), levels=[], rng=rng, context=toks)
            row.levels = [[toks[-1]] + [self._context_token(row, toks) for _ in range(cfg.window - 1)]]
            self._rows[row_id] = row
        row.context = toks
        if cfg.pool_from_context:
            row.pool.insert_from_text(toks[row.pooled_upto:])
            row.pooled_upto = max(row.pooled_upto, len(toks) - cfg.ngram + 1)
        return row

    @staticmethod
    def _context_token(row: _Row, toks: Sequence[int]) -> int:
        return int(toks[row.rng.randrange(len(toks))])

    def _propose_row(self, row_id: int, toks: tuple[int, ...], k: int) -> Proposal:
        cfg = self.config
        row = self._row_for(row_id, toks)
        row.pending_levels = None
        if k <= 0:
            return Proposal()
        root = toks[-1]
        depth = min(cfg.ngram - 1, k)
        guesses = [g[:depth] for g in row.pool.lookup(root, cfg.guess)]
        token_ids, parents = build_trie(guesses)
        h = len(row.levels)
        row.levels[0][0] = root
        cells = window_cells(cfg.window, h)
        if not cells:  # W = 1 with one level: nothing to look ahead with
            return Proposal(token_ids=token_ids, parents=parents if token_ids else None)
        inner, depth_aux = window_mask(cfg.window, h)  # [m, 1 + m]
        n, m = len(token_ids), len(cells)
        mask = torch.cat([inner[:, :1], torch.zeros(m, n, dtype=torch.bool), inner[:, 1:]], dim=1)  # [m, 1 + n + m]
        aux = AuxBlock(token_ids=tuple(row.levels[j][i] for j, i in cells), mask=mask, depth=depth_aux)
        row.pending_levels = h
        return Proposal(token_ids=token_ids, parents=parents, aux=aux)

    def _advance_row(self, row: _Row, verdict: Verdict) -> None:
        cfg = self.config
        h = row.pending_levels
        row.pending_levels = None
        if verdict.aux_logits is None:
            return
        cells = window_cells(cfg.window, h)
        guess_at = dict(zip(cells, verdict.aux_logits.argmax(-1).tolist()))  # (level, col) -> argmax
        # The root's logits are not aux logits; under greedy its argmax is the first emitted token
        # (under sampling, the first sampled one: still a true bigram of the output).
        guess_at[(0, 0)] = verdict.emitted[0]
        top_guess = [int(guess_at[(h - 1, i)]) for i in range(cfg.window)]
        root = row.context[-1]
        if h == cfg.ngram - 1:
            row.pool.insert_all(window_ngrams(row.levels, top_guess, root))
        refill_from = row.context + tuple(verdict.emitted)
        # A one-token advance whatever was accepted (see the module docstring: measured best).
        row.levels = advance_window(row.levels, top_guess, 1, cfg.ngram - 1,
                                    lambda: self._context_token(row, refill_from))


@register("lookahead", trees=True)
def _load(env: ProposerEnv) -> ProposerFactory:
    return lambda: LookaheadProposer(env.config.lookahead)  # a window and a pool per request / session
