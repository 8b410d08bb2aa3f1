"""Medusa heads (Cai et al. 2024, Medusa-1): K small heads on the target's last hidden state.

Head i (0-based) predicts the token i + 1 positions after the last committed token, from the
hidden state whose logits produced that committed token: the target's own output layer
predicts position t + 1 from the state at t, head i predicts t + i + 2. Each head is a stack
of residual blocks `x + SiLU(W x + b)` (W starts at zero, so an untrained head reproduces the
target's next-token guess) followed by the target's own, frozen output layer. Only the blocks
are trained and shipped: K x (hidden^2 + hidden) weights, 1.3 M per head for SmolLM2-135M.

On disk (a directory): `medusa_heads.safetensors` (the blocks, float16) and
`medusa_config.json` naming the target they were trained on, with a fingerprint of its output
layer. Heads trained for another target are refused (`IncompatibleModels`).

Limitation: the output layer is shared, so a head cannot re-weight the vocabulary beyond what
its residual blocks can express in hidden space (the paper also trains a per-head output
layer; at 28 M parameters each that would not fit the package here).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from specdec.errors import IncompatibleModels, ModelLoadError

WEIGHTS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_config.json"
FORMAT = "specdec-medusa-heads/1"
ASSETS = Path(__file__).resolve().parent / "assets" / "medusa"


def target_fingerprint(lm_head_weight: torch.Tensor) -> str:
    """A short hash of the target's output layer [vocab, hidden]: rows sampled at a fixed stride,
    rounded to float16 so a re-dequantized copy of the same weights gives the same value."""
    w = lm_head_weight.detach().float().cpu()
    rows = w[:: max(1, w.shape[0] // 512)][:512]  # [<=512, hidden]
    data = rows.half().numpy().tobytes()
    return hashlib.sha256(data + str(tuple(w.shape)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    target_name: str  # human-readable name of the target the heads were trained on
    target_fingerprint: str  # target_fingerprint() of that target's output layer
    num_layers: int = 1  # residual blocks per head
    # Measured at the end of training on held-out data: accuracy[i][r] = how often head i's
    # rank-r candidate was the right token. Drives the automatic tree.
    accuracy: tuple[tuple[float, ...], ...] = ()
    # The tree "auto" uses for heads without recorded accuracies (hand-made heads); empty: a chain.
    default_tree: tuple[tuple[int, ...], ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)  # recipe, data, budget, measurements

    def to_json(self) -> str:
        d = asdict(self)
        d["format"] = FORMAT
        return json.dumps(d, indent=1)

    @staticmethod
    def from_dict(d: dict) -> "HeadsConfig":
        if d.get("format") != FORMAT:
            raise ModelLoadError(f"not a specdec Medusa heads config (format {d.get('format')!r}, want {FORMAT!r})")
        d = {k: v for k, v in d.items() if k != "format"}
        d["accuracy"] = tuple(tuple(float(x) for x in row) for row in d.get("accuracy", ()))
        d["default_tree"] = tuple(tuple(int(r) for r in p) for p in d.get("default_tree", ()))
        return HeadsConfig(**d)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # start as the identity: head i first guesses t + 1
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The trainable part: per head, `num_layers` residual blocks. `states(h)` maps hidden states
    [..., hidden] to per-head states [..., K, hidden]; the caller applies the output layer."""

    def __init__(self, config: HeadsConfig, vocab_ids: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads))
        # [subset] sorted token ids the heads may draft (None: the whole vocabulary). Drafting
        # only frequent tokens makes the heads' output layer several times cheaper; the target
        # still verifies over its full vocabulary, so the output is unchanged.
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long())

    def states(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> [..., K, hidden]."""
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden [..., hidden] -> [..., K, vocab] through the target's (frozen) output layer."""
        return lm_head(self.states(hidden))


def new_heads(lm, num_heads: int = 4, num_layers: int = 1, target_name: Optional[str] = None,
              vocab_ids: Optional[torch.Tensor] = None) -> MedusaHeads:
    """Untrained heads for the CausalLM `lm` (identity blocks)."""
    if num_heads < 1 or num_layers < 1:
        raise ValueError("need num_heads >= 1 and num_layers >= 1")
    w = lm.embedding_tables()[1]
    config = HeadsConfig(num_heads=num_heads, hidden_size=int(w.shape[1]), vocab_size=int(w.shape[0]),
                         target_name=target_name or lm.name, target_fingerprint=target_fingerprint(w),
                         num_layers=num_layers)
    return MedusaHeads(config, vocab_ids).to(dtype=lm.dtype, device=lm.device)


def save_heads(heads: MedusaHeads, out_dir: str | Path, config: Optional[HeadsConfig] = None) -> Path:
    """Write the blocks (float16) and the config into out_dir (created); returns out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config or heads.config
    state = {k: v.detach().to(torch.float16 if v.is_floating_point() else torch.int32).cpu().contiguous()
             for k, v in heads.state_dict().items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": FORMAT, "target_fingerprint": config.target_fingerprint})
    tmp.replace(out / WEIGHTS_FILE)
    tmp = out / (CONFIG_FILE + ".tmp")
    tmp.write_text(config.to_json())
    tmp.replace(out / CONFIG_FILE)
    return out


def read_config(heads_dir: str | Path) -> HeadsConfig:
    path = Path(heads_dir) / CONFIG_FILE
    if not path.is_file():
        raise ModelLoadError(f"no Medusa heads in {heads_dir}: {CONFIG_FILE} is missing")
    try:
        return HeadsConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"bad Medusa heads config {path}: {exc}") from exc


def check_heads_match(config: HeadsConfig, lm, where: str = "") -> None:
    """Refuse heads trained for another target (other shapes or another output layer)."""
    w = lm.embedding_tables()[1]
    shape = (int(w.shape[0]), int(w.shape[1]))
    if shape != (config.vocab_size, config.hidden_size):
        raise IncompatibleModels(
            f"Medusa heads {where} were trained for {config.target_name} (vocab {config.vocab_size}, hidden "
            f"{config.hidden_size}); this target has vocab {shape[0]}, hidden {shape[1]}")
    got = target_fingerprint(w)
    if got != config.target_fingerprint:
        raise IncompatibleModels(
            f"Medusa heads {where} were trained for {config.target_name} (fingerprint {config.target_fingerprint}); "
            f"this target's output layer differs (fingerprint {got}): train heads for it with `specdec train medusa`")


def load_heads(heads_dir: str | Path, lm) -> MedusaHeads:
    """Load heads from a directory for the CausalLM `lm`, refusing heads trained for another target."""
    from safetensors.torch import load_file

    config = read_config(heads_dir)
    check_heads_match(config, lm, where=str(heads_dir))
    try:
        state = load_file(str(Path(heads_dir) / WEIGHTS_FILE))
        vocab_ids = state.pop("vocab_ids", None)
        if vocab_ids is not None and (vocab_ids.min() < 0 or vocab_ids.max() >= config.vocab_size):
            raise RuntimeError("vocab_ids outside the target's vocabulary")
        heads = MedusaHeads(config, vocab_ids)
        heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        missing = [k for k in heads.state_dict() if k != "vocab_ids" and k not in state]
        if missing:
            raise RuntimeError(f"missing weights {missing[:3]}")
    except (OSError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load Medusa heads from {heads_dir}: {str(exc).splitlines()[0]}") from exc
    heads = heads.to(dtype=lm.dtype, device=lm.device).eval()
    if heads.vocab_ids is not None:
        heads.vocab_ids = heads.vocab_ids.long()  # .to(dtype) above leaves integer buffers alone
    return heads


def shipped_heads_dir(target_name: str) -> Optional[Path]:
    """The heads shipped with the package for a target name, if any."""
    d = ASSETS / target_name
    return d if (d / CONFIG_FILE).is_file() else None
