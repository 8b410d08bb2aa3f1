"""Where a training run stands, kept in its checkpoint and summed over resumed runs (the draft,
Medusa and EAGLE trainers share it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    step: int = 0  # optimizer steps
    tokens_seen: int = 0  # training positions, summed over steps
    elapsed_s: float = 0.0  # wall time of the training, across resumed runs
    history: list = field(default_factory=list)  # [(progress, held-out measures, ...)] at each checkpoint
