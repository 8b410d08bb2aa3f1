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

from typing import Optional, Sequence

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


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def tree_rejection_sample(
    token_ids: Sequence[int],
    parents: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Lossless sampling along a tree of deterministic drafts (SpecInfer's multi-candidate
    rejection sampling with one-hot draft distributions).

    token_ids [n], parents [n] (-1 = root), target_probs [n + 1, vocab] in block index order
    (0 is the root). Returns (accepted node indices along the path, next token).

    With one-hot drafts, SpecInfer's rule at a node (try each child c in turn: keep it with
    probability residual(c), else zero c out of the residual and renormalize; if all fail, draw
    from the residual) is the same distribution as: draw x from target_probs at the node; if x
    is a child's token, descend into that child, else emit x. That is what this does, so every
    emitted token is an exact sample of the target. Consumes one categorical draw per visited node.
    """
    children = _children(parents)
    path: list[int] = []
    node = -1
    while True:
        x = int(torch.multinomial(target_probs[node + 1], 1, generator=generator))
        nxt = next((c for c in children.get(node, ()) if token_ids[c] == x), None)
        if nxt is None:
            return path, x
        path.append(nxt)
        node = nxt


def typical_accept(
    token_ids: Sequence[int],
    parents: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> tuple[list[int], int]:
    """Typical acceptance (Medusa, Cai et al. 2024). LOSSY: the output is *not* distributed as
    the target's samples; it trades exactness for longer accepted paths.

    token_ids [n], parents [n] (-1 = root), target_probs [n + 1, vocab] in block index order.
    A drafted token x at a node whose parent's distribution is P is *typical* when
    P(x) > min(posterior_threshold, posterior_alpha * exp(-H(P))). The deepest node whose whole
    path is typical is accepted (the first such node on ties, as Medusa's argmax over its
    candidate paths); the next token is sampled from the accepted node's distribution
    restricted to its typical tokens. Returns (accepted node indices along the path, next token).
    """
    probs = target_probs.float()  # [n + 1, vocab]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [n + 1]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold),
                              posterior_alpha * torch.exp(-entropy))  # [n + 1]
    best: list[int] = []
    paths: dict[int, list[int]] = {-1: []}
    for i, (tok, p) in enumerate(zip(token_ids, parents)):
        if p in paths and float(probs[p + 1, tok]) > float(threshold[p + 1]):
            paths[i] = paths[p] + [i]
            if len(paths[i]) > len(best):
                best = paths[i]
    at = best[-1] + 1 if best else 0
    typical = probs[at] * (probs[at] > threshold[at])  # [vocab]
    if typical.sum() <= 0:  # cannot happen for alpha < 1 (the top token always passes); stay safe
        typical = probs[at]
    return best, int(torch.multinomial(typical / typical.sum(), 1, generator=generator))
