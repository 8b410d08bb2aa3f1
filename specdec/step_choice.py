"""Which way the coordinator's `auto` takes a session's next step, from what steps have cost.

Two ways to take a step through the services:
- LOCAL: the target alone decodes a chunk of tokens (Decode with method "auto": plain or prompt
  lookup, as the target's measured verify cost decides; no round trip per token);
- DRAFT: the draft service proposes k tokens and the target verifies them (a round trip to each).

Which is faster depends on everything at once: the acceptance rate on these prompts, the draft's
cost next to the target's (c), the target's verify cost v(k), the wire, and how many sessions
share the machines. So `auto` does not predict it: it measures it. `StepRates` keeps, per way,
exponentially weighted means of a step's seconds and of its emitted tokens, as the coordinator's
sessions see them end to end, and picks the way whose ratio (seconds per token) is lower.

The slower way is tried again now and then (one typical step) once the faster way has run for a
while, counted in seconds, not steps (a step may be one token or a whole answer): at first after
explore_after_s, each time it loses again twice as long (up to max_explore_after_s), and never
before the faster way has run 1 / max_share times as long as the last exploration took (2%:
measured, one exploration of a torch draft beside a llama.cpp target cost 0.2-0.4 s, a third of
a short request, and 5% still put one on a few requests of a 28-request benchmark); nor before
a streamed session's first token. So conditions that change (another prompt mix, a loaded
draft) are noticed while a way that keeps losing costs almost nothing. Both ways are lossless,
so a choice changes speed, never the output.

What drafting has measured of the draft's acceptance goes further than its timings: where even
a free draft right that often could not beat the target alone on its verify cost, the draft is
left idle (draft_hopeless), tried again only every max_explore_after_s. The coordinator keeps
that acceptance in its cost store (on disk where it has one), so a restarted coordinator that
knows the draft loses does not pay to find out again.

Limitation: one set of rates per coordinator, shared by its sessions: a session whose prompts
suit drafting far better than the mix (a summary that copies its document) is not told apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LOCAL = "local"
DRAFT = "draft"

# What the coordinator keeps a draft service's acceptance under in its cost store.
ACCEPTANCE_KEY = "draft-service"


def judged_tokens(drafted: int, accepted: int) -> int:
    """Drafted tokens a verification judged: the accepted ones and the first rejected one (those
    after it were never compared). accepted / judged estimates the per-token acceptance rate
    whatever k was, which accepted / drafted underestimates for k > 1."""
    return accepted + (1 if accepted < drafted else 0)


@dataclass
class StepRates:
    weight: float = 0.25  # of the newest observation in the running mean
    explore_after_s: float = 2.0  # seconds of the faster way before the slower is tried again (at first)
    max_explore_after_s: float = 120.0
    max_share: float = 0.02  # of the time, at most, that explorations take
    _gap_s: float = 0.0  # the current wait between tries of the slower way
    _exploring: Optional[str] = None  # the way tried for exploration, until its step is recorded
    _retried: bool = False  # the exploration's first step was not typical (skipped): tried once more
    _sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # way -> running (seconds, tokens) a step
    _spent_s: float = 0.0  # seconds of the steps taken since the last exploration ended
    _explore_s: float = 0.0  # seconds of the open exploration's steps so far
    _last_explore_s: float = 0.0  # seconds the last exploration took

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.explore_after_s <= 0 or not 0 < self.max_share <= 1:
            raise ValueError("weight and max_share must be in (0, 1] and explore_after_s > 0")
        self._gap_s = self.explore_after_s

    @property
    def seconds_per_token(self) -> dict[str, float]:
        """Per way measured so far: the running mean of a step's seconds over that of its tokens."""
        return {way: seconds / tokens for way, (seconds, tokens) in self._sums.items()}

    def faster(self) -> Optional[str]:
        """The way with the lower measured cost per token (None until both are measured)."""
        rates = self.seconds_per_token
        return min((LOCAL, DRAFT), key=rates.__getitem__) if len(rates) == 2 else None

    def wants_draft(self) -> bool:
        """Whether a new session is worth loading into the draft at its start, beside the target's
        prefill: only once drafting has measured the faster way. Before that, the step that first
        drafts loads it (a step not recorded, see skipped), so on a machine that draft and target
        share, the draft's prefill never runs beside the target's (measured: llama.cpp on 2
        threads slowed down many times while another process kept a core busy)."""
        return self.faster() == DRAFT

    def choose(self, draft_available: bool, may_explore: bool = True, draft_hopeless: bool = False) -> str:
        """The way to take the next step (LOCAL whenever no draft is available). may_explore
        False (a session's first token, whose latency a client sees): the way measured faster, or
        LOCAL while either is unmeasured; no exploration starts. draft_hopeless: the draft's
        measured acceptance says it could not pay even if drafting cost nothing (the caller asks
        costmodel.acceptance_can_pay with the target's verify cost): unless drafting has measured
        faster, it is neither measured first nor explored before max_explore_after_s of the
        other way's time (then once, as the prompts may have changed)."""
        if not draft_available:
            return LOCAL
        if not may_explore and self._exploring is None:
            return self.faster() or LOCAL
        if (draft_hopeless and self._exploring is None and self.faster() != DRAFT
                and self._spent_s < self.max_explore_after_s):
            return LOCAL
        for way in (LOCAL, DRAFT):  # each measured once first
            if way not in self._sums:
                return way
        best = self.faster()
        if self._exploring is not None and self._retried:  # its first step said nothing: once more
            return self._exploring
        if self._exploring is None and self._spent_s >= max(self._gap_s, self._last_explore_s / self.max_share):
            self._exploring = DRAFT if best == LOCAL else LOCAL
            return self._exploring
        return best

    def skipped(self, way: str, seconds: float = 0.0) -> None:
        """A step taken `way` that says nothing of its usual cost (the one that loads a session
        into the draft, a short last block): not recorded, but its seconds count toward the time
        explorations take. An exploration's step that was skipped is taken once more (the next
        one finds the draft loaded), and then given up until the next exploration, so an
        exploration never stays open for good."""
        if way != self._exploring:
            if self._second_measured(way):
                self._explore_s += max(seconds, 0.0)
            else:
                self._spent_s += max(seconds, 0.0)
            return
        self._explore_s += max(seconds, 0.0)
        if self._retried:
            self._end_exploration()
        else:
            self._retried = True

    def _second_measured(self, way: str) -> bool:
        """Whether a step taken `way` is the first measurement of the second way: it costs what an
        exploration costs (the draft loaded, say), and the first exploration waits for its share."""
        return len(self._sums) == 1 and way not in self._sums

    def _end_exploration(self) -> None:
        self._exploring, self._retried = None, False
        self._explored()

    def _explored(self) -> None:
        """An exploration (or the second way's first measurement) is over: its seconds are the
        last exploration's, and the faster way's time is counted from now."""
        self._last_explore_s, self._explore_s, self._spent_s = self._explore_s, 0.0, 0.0

    def record(self, way: str, seconds: float, emitted: int) -> None:
        """A step taken `way` emitted `emitted` tokens in `seconds` (end to end)."""
        if emitted <= 0 or seconds < 0:
            return
        first = self._second_measured(way)
        if way == self._exploring or first:
            self._explore_s += seconds
        else:
            self._spent_s += seconds
        # Running means of seconds and of tokens per step, and their ratio: the cost of a token
        # (a mean of per-step ratios would let one unlucky step, 1 token for a whole block, weigh
        # as much as many good ones).
        old = self._sums.get(way)
        w = self.weight
        self._sums[way] = (seconds, emitted) if old is None else ((1 - w) * old[0] + w * seconds,
                                                                  (1 - w) * old[1] + w * emitted)
        if first:
            self._explored()
        if way == self._exploring:
            self._end_exploration()
            still_slower = self.faster() != way
            self._gap_s = min(2 * self._gap_s, self.max_explore_after_s) if still_slower else self.explore_after_s


@dataclass
class DraftCost:
    """A draft's cost c as the coordinator's steps measure it, end to end: a Propose's seconds
    per drafted token (its round trip and the draft's catch-up on the tokens committed since
    included) over a target step's, which the same step's Verify gives as its seconds over the
    target's v(k+1). A running mean (weight of the newest step), None until a step is seen."""

    weight: float = 0.25
    c: Optional[float] = None

    def record(self, k: int, propose_s: float, verify_s: float, v_next: float) -> None:
        """A step drafted k tokens in propose_s; verifying them (k+1 tokens: v_next single steps) took verify_s."""
        if k < 1 or propose_s < 0 or verify_s <= 0 or v_next <= 0:
            return
        sample = (propose_s / k) / (verify_s / v_next)
        self.c = sample if self.c is None else (1 - self.weight) * self.c + self.weight * sample
