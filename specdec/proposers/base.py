"""The proposer interface and its public registry.

A proposer turns the committed tokens into drafted tokens (`propose`) and may learn from the
target's verdicts (`observe`). An empty proposal means plain decoding for that step. A new
proposer registers itself with `@register("name")`; nothing else needs to change.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from specdec.types import Proposal, ProposeContext, Verdict


@runtime_checkable
class Proposer(Protocol):
    """Proposers may subclass this to inherit the defaults below."""

    name: str
    # True: propose() reads ctx.target_hidden, so the loop keeps the target's last hidden state.
    needs_hidden: bool = False

    def propose(self, ctx: ProposeContext) -> Sequence[Proposal]:
        """One proposal per row of ctx, in the same order; at most ctx.k[b] tokens deep."""
        ...

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        """The target's verdicts for the last proposals (same order). Default: nothing to learn."""


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register(name: str) -> Callable[[Callable[..., Proposer]], Callable[..., Proposer]]:
    def deco(factory: Callable[..., Proposer]) -> Callable[..., Proposer]:
        if name in PROPOSERS:
            raise ValueError(f"proposer {name!r} is already registered")
        PROPOSERS[name] = factory
        return factory

    return deco


def make_proposer(name: str, **kwargs) -> Proposer:
    try:
        factory = PROPOSERS[name]
    except KeyError:
        raise KeyError(f"unknown proposer {name!r}; known: {', '.join(sorted(PROPOSERS))}") from None
    return factory(**kwargs)
