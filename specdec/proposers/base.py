"""The proposer interface and the public registry of decoding methods.

A proposer turns the committed tokens into drafted tokens (`propose`) and may learn from the
target's verdicts (`observe`). An empty proposal means plain decoding for that step.

The registry maps each method's name (as the CLI, the engine and the services spell it) to a
*loader*: given a `ProposerEnv`, it loads what the method needs once (a draft model, Medusa
heads) and returns a factory of proposers, called once per request or session. A new method
is one module with a proposer and a loader decorated with `@register("name")`, plus its import
in specdec/proposers/__init__.py; the engine, the CLI, the benchmark and the target service
take it from here. "plain" (no proposer) is the one method outside the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from specdec.errors import InvalidRequest
from specdec.types import Proposal, ProposeContext, Verdict

if TYPE_CHECKING:
    from specdec.costmodel import CostStore
    from specdec.backends.hf import CausalLM

PLAIN = "plain"


@runtime_checkable
class Proposer(Protocol):
    """Proposers may subclass this to inherit the defaults below."""

    name: str
    # True: propose() reads ctx.target_hidden, so the loop keeps the target's last hidden state.
    needs_hidden: bool = False
    # True: propose() reads ctx.target_features, the target's hidden states at every committed
    # position (handed over once each), so the loop keeps them until the proposer has them.
    needs_features: bool = False

    def propose(self, ctx: ProposeContext) -> Sequence[Proposal]:
        """One proposal per row of ctx, in the same order; at most ctx.k[b] tokens deep."""
        ...

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        """The target's verdicts for the last proposals (same order). Default: nothing to learn."""


@dataclass(frozen=True)
class ProposerEnv:
    """What a method's proposers are built from."""

    target: "CausalLM"
    # The user's method settings: specdec.engine.EngineConfig (medusa_heads, medusa_tree, lookahead),
    # not imported here, since the engine builds on the proposers.
    config: Any
    costs: "CostStore"  # this machine's measured costs, for automatic choices (the Medusa tree)
    # The draft model, loaded on first call; raises FailedPrecondition where none runs (the target service).
    load_draft: Callable[[], "CausalLM"]
    # Whether the loop these proposers run in hands them ctx.target_features (needs_features):
    # speculative_generate and the target service's Decode do.
    gives_features: bool = False


ProposerFactory = Callable[[], Proposer]
Loader = Callable[[ProposerEnv], ProposerFactory]
PROPOSERS: dict[str, Loader] = {}
# Methods whose blocks must be trees (Lookahead's window rides beside its candidates): they need a
# target whose `runs_trees` is true (the torch backends), not one that runs causal chains only
# (llama.cpp). Medusa is not one: its tree can be a chain.
TREE_METHODS: set[str] = set()


def register(name: str, trees: bool = False) -> Callable[[Loader], Loader]:
    """trees: the method's blocks must be trees (see TREE_METHODS)."""

    def deco(loader: Loader) -> Loader:
        if name in PROPOSERS or name == PLAIN:
            raise ValueError(f"method {name!r} is already registered")
        PROPOSERS[name] = loader
        if trees:
            TREE_METHODS.add(name)
        return loader

    return deco


def needs_trees(method: str) -> bool:
    """Whether the method needs a target that runs tree blocks."""
    return method in TREE_METHODS


def check_runs(method: str, target: "CausalLM") -> None:
    """Refuse, with a message that says what to do, a method this target cannot run."""
    if needs_trees(method) and not target.runs_trees:
        raise InvalidRequest(f"method {method} verifies tree blocks, which {target.name} on this backend does not "
                             "run (llama.cpp runs causal chains only): use backend fast or hf, or auto")


def method_names() -> tuple[str, ...]:
    """Every decoding method: plain, then the registered ones."""
    return (PLAIN, *PROPOSERS)


def load_proposer(name: str, env: ProposerEnv) -> ProposerFactory:
    """The method's proposer factory (loading what it needs now: a missing model fails here)."""
    try:
        loader = PROPOSERS[name]
    except KeyError:
        raise InvalidRequest(f"unknown method {name!r}; choose one of {', '.join(method_names())}") from None
    check_runs(name, env.target)
    return loader(env)
