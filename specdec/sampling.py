"""Logits -> probabilities (temperature, top-k, top-p) and seeded sampling.

Greedy is the temperature-0 limit: a one-hot distribution at the argmax. Sampling and greedy
therefore share one code path in the acceptance rules; the loop only takes the cheaper
`greedy_accept` shortcut, which is the same rule specialised to one-hot distributions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specdec.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] -> probs [..., vocab] (float32), after temperature, top-k and top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


# Salted so a draft model's draws are not the target's, which come from the same request seed.
_DRAFT_SALT = 0x5EED


def draft_seed(seed: Optional[int]) -> Optional[int]:
    """The seed a draft model samples from, given the request's (None stays None: fresh randomness)."""
    return None if seed is None else seed ^ _DRAFT_SALT


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [..., vocab] -> token ids [...] drawn independently per row."""
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, vocab]
    ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [rows]
    return ids.reshape(probs.shape[:-1])


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """probs [rows, vocab] -> token ids [rows], row b drawn from generators[b] alone."""
    return torch.stack([sample(row, gen) for row, gen in zip(probs, generators)])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [vocab]: argmax under greedy, else a seeded sample."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits, params), generator))
