"""What earlier sessions said, as drafts for the next: the token sequences of recent sessions
(prompt and answer), indexed by n-gram, and the continuation that followed the longest match of
a context's end among them (suffix drafting, as in SuffixDecoding, Oliaro et al. 2024, and
vLLM's `suffix` method; prompt lookup does the same within one sequence).

A prompt that comes again, an agent's loop re-sending its conversation with the same tool calls,
code regenerated with a small edit: the target's answer repeats what it said before, and a
forward over many tokens verifies them at a fraction of their one-by-one cost. The target checks
every drafted token, so the output is the target's own (greedy: token for token; sampling: the
draft is one-hot, rejection sampling keeps the target's distribution).

Bounded: at most `max_tokens` tokens are kept; the oldest sequences go first.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional, Sequence

from specdec.costmodel import best_k
from specdec.proposers.base import Proposer
from specdec.step_choice import judged_tokens
from specdec.types import Proposal, ProposeContext, SamplingParams, Verdict

# The fewest tokens of a row's end that must match an earlier sequence for a draft; the
# acceptance rate assumed for matches of a length not yet measured (MatchAcceptance); the most
# tokens a history draft holds (the cost model picks fewer where they would not pay).
MIN_MATCH = 12
PRIOR_ALPHA = 0.7
MAX_DRAFT = 32


def match_length(context: Sequence[int], seq: Sequence[int], end: int, limit: int) -> int:
    """How many tokens before `end` in seq equal the end of context (at most limit)."""
    n = 0
    while n < limit and n < end and n < len(context) and seq[end - 1 - n] == context[-1 - n]:
        n += 1
    return n


class TokenHistory:
    """Recent sessions' token sequences and an index of their n-grams (key: the n tokens ending
    at a position; value: where, newest last): at most ~250 bytes a kept token (measured with
    tracemalloc, every n-gram distinct), 31 MiB at the default budget. Thread-safe: the target
    service's model thread drafts from it while its event loop adds finished sessions."""

    def __init__(self, max_tokens: int = 1 << 17, n: int = 8, candidates: int = 8, max_match: int = 64):
        if n < 1 or max_tokens < n or candidates < 1 or max_match < n:
            raise ValueError("need n >= 1, max_tokens >= n, candidates >= 1, max_match >= n")
        self.max_tokens, self.n, self.candidates, self.max_match = max_tokens, n, candidates, max_match
        self._seqs: deque[tuple[int, tuple[int, ...]]] = deque()  # (sequence number, tokens), oldest first
        self._first = 0  # the sequence number of _seqs[0]
        self._next = 0
        # hash of an n-gram -> [(sequence number, end)], oldest first (a collision only shortens a match:
        # match_length compares the tokens themselves)
        self._index: dict[int, list[tuple[int, int]]] = {}
        self._kept: set[int] = set()  # hashes of the kept sequences
        self.tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep a finished session's tokens (a sequence longer than the whole budget keeps its end)."""
        seq = tuple(int(t) for t in tokens)[-self.max_tokens:]
        if len(seq) <= self.n:
            return
        whole = hash(seq)
        with self._lock:
            if whole in self._kept:  # (a prompt answered again the same way: nothing new to draft from)
                return
            number = self._next
            self._next += 1
            self._seqs.append((number, seq))
            self._kept.add(whole)
            self.tokens += len(seq)
            index = self._index
            for end, gram in enumerate(self._grams(seq), start=self.n):  # (the last one has no continuation)
                index.setdefault(hash(gram), []).append((number, end))
            while self.tokens > self.max_tokens:
                self._drop_oldest()

    def _grams(self, seq: tuple[int, ...]):
        """The n-grams of seq that end before its last token, in order (n-tuples made in C)."""
        return zip(*(seq[i:len(seq) - self.n + i] for i in range(self.n)))

    def _drop_oldest(self) -> None:
        number, seq = self._seqs.popleft()
        self._first = number + 1
        self.tokens -= len(seq)
        self._kept.discard(hash(seq))
        for gram in self._grams(seq):
            key = hash(gram)
            places = self._index.get(key)
            if places is None:
                continue
            gone = 0  # this sequence's places come first: every older one went before it
            while gone < len(places) and places[gone][0] <= number:
                gone += 1
            del places[:gone]
            if not places:
                del self._index[key]

    def continuation(self, context: Sequence[int], k: int, min_match: int) -> tuple[int, tuple[int, ...]]:
        """(match length, up to k tokens): what followed the longest match (at least min_match
        tokens, newest first among equals) of the end of context in the kept sequences; (0, ())
        where none is that long."""
        if k < 1 or len(context) < max(self.n, min_match):
            return 0, ()
        key = hash(tuple(int(t) for t in context[-self.n:]))
        with self._lock:
            places = self._index.get(key)
            if not places:
                return 0, ()
            best, best_cont = 0, ()
            for number, end in reversed(places[-self.candidates:]):
                seq = self._seqs[number - self._first][1]
                m = match_length(context, seq, end, self.max_match)
                if m > best:
                    best, best_cont = m, seq[end:end + k]
        return (best, best_cont) if best >= min_match else (0, ())


def drafts_for(sampling: SamplingParams) -> bool:
    """Whether plain decoding may draft from the history under these settings: greedy, or sampling
    without a seed (a seeded session's draws would depend on what other sessions said before it)."""
    return sampling.greedy or sampling.seed is None


class MatchAcceptance:
    """How often history drafts were right, by the length of the match they came from (a prompt
    that comes again matches over its whole length; a phrase met before, over a few tokens): the
    acceptance rate the cost model weighs for the next draft from a match that long. Counts of
    drafted tokens judged (accepted, or the first rejected of a block) and accepted, each bucket
    starting from `prior` as if `prior_weight` tokens had been judged; halved past `window`, so
    the figures follow what users send now."""

    BUCKETS = (12, 16, 24, 32, 48, 64)  # lower bounds of the match lengths of each bucket

    def __init__(self, prior: float = PRIOR_ALPHA, prior_weight: float = 4.0, window: float = 4096.0):
        self.prior, self.prior_weight, self.window = prior, prior_weight, window
        self._counts = [[0.0, 0.0] for _ in self.BUCKETS]  # [accepted, judged]

    def bucket(self, match: int) -> int:
        return max((i for i, lo in enumerate(self.BUCKETS) if match >= lo), default=0)

    def alpha(self, bucket: int) -> float:
        accepted, judged = self._counts[bucket]
        return (accepted + self.prior * self.prior_weight) / (judged + self.prior_weight)

    def record(self, bucket: int, drafted: int, accepted: int) -> None:
        counts = self._counts[bucket]
        counts[0] += accepted
        counts[1] += judged_tokens(drafted, accepted)
        if counts[1] > self.window:
            counts[0] /= 2
            counts[1] /= 2


class HistoryProposer(Proposer):
    """Drafts what followed the longest match of a row's end (min_match tokens or more) in the
    kept sequences, as many tokens as the cost model finds best (costmodel.best_k: a draft that
    costs nothing to make, at the acceptance measured for matches that long, on the target's
    verify cost); nothing where none matches that long or drafting would not pay (the step is
    then a plain one, or `fallback`'s at up to `fallback_k` tokens: prompt lookup beside it). A
    bucket whose drafts do not pay is still tried with one token every `probe_every`-th time it
    matches, so its figure can recover."""

    name = "history"

    def __init__(self, history: TokenHistory, verify_cost: dict[int, float], acceptance: MatchAcceptance,
                 min_match: int = MIN_MATCH, probe_every: int = 16, fallback: Optional[Proposer] = None,
                 fallback_k: int = 0):
        if min_match < history.n:
            raise ValueError(f"min_match must be >= the history's n-gram size {history.n}")
        self.history, self.verify_cost, self.acceptance = history, verify_cost, acceptance
        self.min_match, self.probe_every = min_match, probe_every
        self.fallback, self.fallback_k = fallback, fallback_k
        # per row of the last proposal: its match's bucket (None: no history draft), whether fallback drafted it
        self._buckets: list[Optional[int]] = []
        self._fell_back: list[bool] = []
        self._passes = 0

    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        out, self._buckets, self._fell_back = [], [], []
        for row, toks, k in zip(ctx.row_ids, ctx.token_ids, ctx.k):
            match, cont = self.history.continuation(toks, k, self.min_match)
            bucket = self.acceptance.bucket(match) if cont else None
            if cont:
                n = best_k(self.acceptance.alpha(bucket), 0.0, self.verify_cost, range(len(cont) + 1))
                if n == 0:
                    self._passes += 1
                    n = 1 if self._passes % self.probe_every == 0 else 0
                cont = cont[:n]
            fall_back = not cont and self.fallback is not None and min(k, self.fallback_k) > 0
            if fall_back:
                one = ProposeContext(row_ids=(row,), token_ids=(toks,), k=(min(k, self.fallback_k),),
                                     sampling=ctx.sampling)
                out.append(self.fallback.propose(one)[0])
            else:
                out.append(Proposal(token_ids=cont))
            self._buckets.append(bucket if cont else None)
            self._fell_back.append(fall_back)
        return out

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for bucket, fell_back, v in zip(self._buckets, self._fell_back, verdicts):
            if bucket is not None:
                self.acceptance.record(bucket, v.num_drafted, v.num_accepted)
            elif fell_back:
                self.fallback.observe([v])
