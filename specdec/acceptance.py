"""Acceptance rules: pure, seeded functions of the drafted tokens and the target's scores.

`rejection_sample` is speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft
token x_i is kept with probability min(1, target_probs[x_i] / draft_probs[x_i]); at the first
rejection a *recovered* token is drawn from norm(max(0, target_probs - draft_probs)); if all k
are kept a *bonus* token is drawn from the target's next distribution. The emitted tokens are
then distributed exactly as the target's own samples.

`greedy_accept` is the same rule for one-hot distributions: keep the longest prefix that
matches the target's argmax, then emit the target's argmax.
"""

from __future__ import annotations

from typing import Optional

import torch


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_ids [k], target_logits [k + 1, vocab] -> (num_accepted, next_token).

    target_logits[i] scores the position of draft_ids[i]; target_logits[k] gives the bonus.
    """
    target_ids = target_logits.argmax(-1)  # [k + 1]
    k = draft_ids.shape[0]
    mismatch = (draft_ids != target_ids[:k]).nonzero()
    num_accepted = int(mismatch[0]) if mismatch.numel() else k
    return num_accepted, int(target_ids[num_accepted])


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """draft_ids [k], draft_probs [k, vocab] or None, target_probs [k + 1, vocab] -> (num_accepted, next_token).

    draft_probs None means the proposer is deterministic (a one-hot draft distribution), as for
    prompt lookup: each token is then kept with probability target_probs[x_i].
    Always consumes k uniforms plus one categorical draw from the generator.
    """
    k = draft_ids.shape[0]
    idx = torch.arange(k)
    target_p = target_probs[idx, draft_ids]  # [k]
    draft_p = draft_probs[idx, draft_ids] if draft_probs is not None else torch.ones(k)  # [k]
    uniforms = torch.rand(k, generator=generator)  # [k]
    # u < p/q written as u * q < p: no division, and a token the target forbids (p = 0) never passes.
    rejected = (uniforms * draft_p >= target_p).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(target_probs[k], 1, generator=generator)
        return k, int(bonus)
    j = int(rejected[0])
    if draft_probs is not None:
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)  # [vocab]
    else:
        residual = target_probs[j].clone()
        residual[draft_ids[j]] = 0.0
    total = residual.sum()
    # The residual is empty only when target == draft at j, where rejection has probability 0;
    # floating-point rounding can still land here, and the target's own distribution is then exact.
    recovered_from = residual / total if total > 0 else target_probs[j]
    recovered = torch.multinomial(recovered_from, 1, generator=generator)
    return j, int(recovered)
