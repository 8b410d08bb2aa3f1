"""Plain frozen dataclasses passed between the stages of the decoding loop.

Vocabulary: `k` drafted tokens per step; *accepted* draft tokens are kept by
the target; the *recovered* token is sampled from the residual at the first rejection; the
*bonus* token is the extra target token when all k are accepted; *emitted* = accepted + 1.
τ (mean acceptance length) = emitted tokens per target forward; α = accepted / drafted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from specdec.errors import InvalidRequest


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance: LOSSY, opt-in. A drafted token x is kept when the target gives
    it P(x) > min(posterior_threshold, posterior_alpha * exp(-entropy(P)))."""

    posterior_threshold: float = 0.09  # Medusa's default epsilon
    posterior_alpha: float = 0.3  # Medusa's default delta (~ sqrt of epsilon)

    def __post_init__(self) -> None:
        if not (0.0 < self.posterior_threshold <= 1.0):
            raise InvalidRequest(f"posterior_threshold must be in (0, 1], got {self.posterior_threshold}")
        if not (0.0 < self.posterior_alpha < 1.0):
            raise InvalidRequest(f"posterior_alpha must be in (0, 1), got {self.posterior_alpha}")


MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax); greedy is the lossless default
    top_k: int = 0  # 0 disables top-k filtering
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    seed: Optional[int] = None  # None: fresh randomness; an int makes sampling reproducible
    # None: lossless acceptance (the default). Set: typical acceptance when sampling (lossy);
    # greedy decoding ignores it and stays exact.
    typical: Optional[TypicalAcceptance] = None

    def __post_init__(self) -> None:
        # Every comparison is written so that NaN fails it. Below MIN_TEMPERATURE, logits / temperature
        # overflows float32 to inf (NaN probabilities); above MAX_TEMPERATURE sampling is uniform noise:
        # both are typos, refused here rather than failing inside a service's batch.
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                                 f"got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class StopConditions:
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these (kept in the output)
    stop_strings: tuple[str, ...] = ()  # generation stops once the text contains one (cut from the text)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise InvalidRequest("stop strings must be non-empty")


@dataclass(frozen=True)
class ProposeContext:
    """What a proposer sees for one step, one entry per active sequence (row)."""

    row_ids: tuple[int, ...]  # stable identity of each sequence across steps (rows leave as they finish)
    token_ids: tuple[tuple[int, ...], ...]  # committed tokens per row: prompt + generated so far
    k: tuple[int, ...]  # how many tokens to draft per row (a proposer may return fewer)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Only for proposers with `needs_hidden = True` (e.g. Medusa heads): per row, the target's
    # last-layer hidden state [hidden] at the token before the last committed one, i.e. the
    # state whose logits produced the last committed token.
    target_hidden: Optional[tuple[torch.Tensor, ...]] = None
    # Only for proposers with `needs_features = True` (EAGLE drafts): per row, [n, hidden] the
    # target's last-layer hidden states (after the final norm) at the committed positions this
    # proposer has not been given yet, in order: every prompt position at the first step, then
    # the root and accepted path of each verified block. They always end at the token before
    # the last committed one (the last one is the next block's root: its state is not known yet).
    target_features: Optional[tuple[torch.Tensor, ...]] = None
    # Sampling proposers only: per row, the generator that row's samples come from, so a seeded
    # row drafts the same tokens whatever rows share its batch. None: the proposer's own generator.
    generators: Optional[tuple[torch.Generator, ...]] = None


@dataclass(frozen=True)
class AuxBlock:
    """Extra inputs scored in the same target forward as the candidates but never accepted,
    e.g. Lookahead's Jacobi window. Their logits come back in the Verdict."""

    token_ids: tuple[int, ...]  # [m]
    # [m, 1 + n + m] bool: what each aux input attends to inside the block, whose columns are
    # the root (last committed token), the n candidate nodes, then the m aux inputs.
    mask: torch.Tensor
    depth: tuple[int, ...]  # [m] position offset of each aux input from the root

    def __post_init__(self) -> None:
        m = len(self.token_ids)
        if len(self.depth) != m or self.mask.dim() != 2 or self.mask.shape[0] != m:
            raise ValueError("aux block: token_ids, depth and mask rows must have the same length")


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens for one sequence. Empty means: decode one token plainly this step."""

    token_ids: tuple[int, ...] = ()  # [n] drafted nodes in forward order
    # Tree proposals: parent node index of each node, -1 for the last committed token.
    # None means a chain (node i's parent is i - 1).
    parents: Optional[tuple[int, ...]] = None
    # [n, vocab] distribution each chain token was sampled from. None means the proposer is
    # deterministic (prompt lookup, greedy drafting): rejection sampling then treats it as one-hot.
    draft_probs: Optional[torch.Tensor] = None
    aux: Optional[AuxBlock] = None  # inputs scored alongside, never accepted

    def __post_init__(self) -> None:
        if self.aux is not None and self.aux.mask.shape[1] != 1 + len(self.token_ids) + len(self.aux.token_ids):
            raise ValueError("aux mask must have 1 + n + m columns")
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids):
                raise ValueError("parents must have one entry per node")
            if any(not (-1 <= p < i) for i, p in enumerate(self.parents)):
                raise ValueError("each node's parent must come before it (or be -1)")
            if self.draft_probs is not None:
                raise ValueError("draft_probs are only defined for chain proposals")

    @property
    def is_chain(self) -> bool:
        return self.parents is None


class DraftKind(enum.Enum):
    """How drafted tokens were chosen, which under sampling picks the acceptance rule."""

    DETERMINISTIC = "deterministic"  # argmax or lookup drafts: a one-hot draft distribution
    SAMPLED = "sampled"  # sampled from draft_probs, which rejection sampling then needs


@dataclass(frozen=True)
class Verdict:
    """What the target decided for one sequence in one step (also the target service's answer to
    Verify, a session's one row)."""

    row_id: int
    num_drafted: int
    num_accepted: int
    emitted: tuple[int, ...]  # accepted draft tokens + the recovered or bonus token (before stop truncation)
    aux_logits: Optional[torch.Tensor] = None  # [m, vocab] target logits of the proposal's aux inputs


@dataclass
class GenerationStats:
    """Raw counters for one sequence; rates are derived, never stored."""

    target_forwards: int = 0  # prefill included: plain decoding has tau == 1
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    elapsed_s: float = 0.0
    draft_s: float = 0.0  # wall time of the propose calls the sequence took part in (its batch's)

    @property
    def tau(self) -> float:
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # generated tokens only (EOS included when it ended the sequence)
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats


# --- what the services answer (specdec/rpc/clients.py builds these from the wire) -------------

@dataclass(frozen=True)
class ModelInfo:
    """A service's model facts (its Info call)."""

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_positions: int
    max_k: int
    methods: tuple[str, ...] = ()
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    drafting_cannot_pay: bool = False  # target only: see common.proto ModelInfo
    verify_cost: dict[int, float] = field(default_factory=dict)  # target only: v(k), see common.proto


@dataclass(frozen=True)
class DraftBlock:
    """The draft service's answer to Propose."""

    token_ids: tuple[int, ...]
    draft_probs: Optional[torch.Tensor]  # [k, vocab], sampling only
    guess: Optional[int]  # the draft's guess of the token after the block (pipelining)
    kind: DraftKind = DraftKind.DETERMINISTIC  # SAMPLED when drafted under sampling (with draft_probs)


@dataclass(frozen=True)
class DecodeResult:
    """The target service's answer to Decode: several steps with a target-side method."""

    emitted: tuple[int, ...]
    method: str
    target_forwards: int
    num_drafted: int
    num_accepted: int
