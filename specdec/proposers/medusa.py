"""Medusa proposer: the heads read the target's hidden state and draft a tree of candidates
that the target verifies in its next forward (Cai et al. 2024, Medusa-1).

Per step and row: the heads turn `ctx.target_hidden[b]` (the state whose logits produced the
last committed token) into K next-token distributions for the positions after it; the tree
(a list of paths, compiled once) picks, for each node at depth d, one of head d-1's top
candidates. The loop verifies the whole tree in one forward with a tree attention mask and
keeps the accepted path's KV entries.

Acceptance is the loop's: greedy (lossless, the default); sampling along the tree is exact,
because the candidates are a deterministic function of the hidden state (one-hot draft
distributions); typical acceptance is the opt-in lossy mode (`SamplingParams.typical`).

Tree choice (`tree=`): "auto" (heads with recorded per-rank accuracies: the greedy tree whose
size maximizes (1 + expected accepted tokens) / v(nodes + 1), with v the verify-cost curve
measured on the target as it runs here, once per machine (costmodel.CostStore): a few nodes on
a CPU, wide trees on a GPU; heads without accuracies: their recorded default tree, else a chain), "chain", a number N
(the N-node tree that maximizes expected accepted length under the heads' measured per-rank
accuracies), a JSON list of paths, or a .json file holding one. A row never drafts deeper
than its ctx.k.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from specdec.costmodel import CostStore, verify_cost_at
from specdec.errors import InvalidRequest, ModelLoadError
from specdec.backends.hf import CausalLM
from specdec.medusa_heads import MedusaHeads, load_heads, shipped_heads_dir
from specdec.proposers.base import Proposer, ProposerEnv, ProposerFactory, register
from specdec.tree import (CompiledTree, best_tree_for_cost, chain_tree, compile_tree, expected_accept_length,
                          greedy_tree)
from specdec.types import Proposal, ProposeContext

AUTO_MAX_NODES = 64  # the automatic tree's size is chosen in 1..AUTO_MAX_NODES


def resolve_tree(spec, heads: MedusaHeads, target: Optional[CausalLM] = None,
                 costs: Optional[CostStore] = None) -> list[tuple[int, ...]]:
    """A tree setting (see the module docstring) -> list of paths for these heads. "auto" uses
    the verify cost of `target` when given (from `costs`; default: measured in this process)."""
    cfg = heads.config
    if target is not None and not target.runs_trees:
        return _chain_for(spec, heads, target, costs)
    if spec is None or spec == "auto":
        if cfg.accuracy and target is not None:
            curve = (costs or CostStore()).verify_cost(target)
            return best_tree_for_cost(cfg.accuracy, lambda m: verify_cost_at(curve, m), AUTO_MAX_NODES)
        if cfg.default_tree:
            return [tuple(p) for p in cfg.default_tree]
        return chain_tree(cfg.num_heads)
    if isinstance(spec, str):
        s = spec.strip()
        if s == "chain":
            return chain_tree(cfg.num_heads)
        if s.isdigit():
            if not cfg.accuracy:
                raise InvalidRequest(f"--tree {s} needs heads with measured accuracies; pass a list of paths")
            if int(s) < 1:
                raise InvalidRequest("a tree needs at least 1 node")
            return greedy_tree(cfg.accuracy, int(s))
        if s.startswith("["):
            try:
                spec = json.loads(s)
            except ValueError as exc:
                raise InvalidRequest(f"--tree is not valid JSON: {exc}") from None
        elif s.endswith(".json"):
            if not Path(s).is_file():
                raise InvalidRequest(f"tree file not found: {s}")
            spec = json.loads(Path(s).read_text())
        else:
            raise InvalidRequest(f"unknown tree {spec!r}: use auto, chain, a node count, or a JSON list of paths")
    try:
        paths = [tuple(int(r) for r in p) for p in spec]
    except (TypeError, ValueError):
        raise InvalidRequest("a tree is a list of paths, each a list of candidate ranks, e.g. [[0], [0, 0], [1]]") from None
    deepest = max((len(p) for p in paths), default=0)
    if deepest > cfg.num_heads:
        raise InvalidRequest(f"the tree is {deepest} deep but there are only {cfg.num_heads} Medusa heads")
    return paths


def _chain_for(spec, heads: MedusaHeads, target: CausalLM, costs: Optional[CostStore]) -> list[tuple[int, ...]]:
    """The tree on a target that runs causal chains only (llama.cpp): "auto" -> the chain of top
    candidates whose depth maximizes (1 + expected accepted) / v(depth + 1) (depth 0: plain
    steps), "chain" -> as deep as the heads go; anything branching is refused."""
    cfg = heads.config
    if spec is None or spec == "auto":
        if not cfg.accuracy:
            return chain_tree(cfg.num_heads)
        curve = (costs or CostStore()).verify_cost(target)
        depth = max(range(cfg.num_heads + 1), key=lambda d: ((1.0 + expected_accept_length(chain_tree(d), cfg.accuracy))
                                                            / verify_cost_at(curve, d + 1), -d))
        return chain_tree(depth)
    if isinstance(spec, str) and spec.strip() == "chain":
        return chain_tree(cfg.num_heads)
    raise InvalidRequest(f"{target.name} runs on a backend that verifies causal chains only (llama.cpp): "
                         "use --tree auto or chain, or backend fast or hf for tree-shaped Medusa")


class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden = True

    def __init__(self, target: CausalLM, heads: MedusaHeads, tree=None, costs: Optional[CostStore] = None):
        self.heads = heads.eval()
        weight = target.embedding_tables()[1].detach()  # [vocab, hidden]
        self.vocab_ids = heads.vocab_ids  # [subset] or None
        # [subset or vocab, hidden]: the output rows the heads may draft, gathered once.
        self.weight = weight[self.vocab_ids] if self.vocab_ids is not None else weight
        self.bias = target.output_bias()  # [vocab] or None
        if self.bias is not None and self.vocab_ids is not None:
            self.bias = self.bias[self.vocab_ids]
        try:
            self.tree: CompiledTree = compile_tree(resolve_tree(tree, heads, target, costs))
        except ValueError as exc:
            raise InvalidRequest(f"bad Medusa tree: {exc}") from None
        # A tree of depth 0 (`--tree auto` where drafting does not pay, e.g. llama.cpp on a CPU)
        # drafts nothing: it reads no hidden state, which llama.cpp would compute at a cost.
        self.needs_hidden = self.tree.max_depth > 0
        self._by_depth: dict[int, CompiledTree] = {}
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tree_for(self, k: int) -> CompiledTree:
        if k not in self._by_depth:
            self._by_depth[k] = self.tree.pruned(k)
        return self._by_depth[k]

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> list[Proposal]:
        trees = [self._tree_for(k) for k in ctx.k]
        depth = max(t.max_depth for t in trees)
        if depth == 0:
            return [Proposal() for _ in ctx.row_ids]
        if ctx.target_hidden is None:
            raise ValueError("the medusa proposer needs the target's hidden state (needs_hidden)")
        hidden = torch.stack(list(ctx.target_hidden))  # [rows, hidden]
        states = torch.stack([self.heads.blocks[i](hidden) for i in range(depth)], dim=1)  # [rows, depth, hidden]
        logits = states @ self.weight.T  # [rows, depth, subset]
        if self.bias is not None:
            logits = logits + self.bias
        top = logits.topk(self.tree.top_needed(), dim=-1).indices  # [rows, depth, top]
        if self.vocab_ids is not None:
            top = self.vocab_ids[top]
        top = top.cpu()
        out = []
        for b, tree in enumerate(trees):
            if tree.num_nodes == 0:
                out.append(Proposal())
                continue
            head = torch.tensor(tree.head)  # [n]
            rank = torch.tensor(tree.rank)  # [n]
            out.append(Proposal(token_ids=tuple(top[b, head, rank].tolist()), parents=tree.parents))
        return out


def heads_for_target(target_name: str, heads_dir: Optional[str], lm: CausalLM) -> MedusaHeads:
    """Load heads from heads_dir, or the ones shipped for the target; refuse a mismatch."""
    if not lm.returns_hidden:
        raise InvalidRequest(f"Medusa heads read the target's hidden states, which {type(lm).__name__} does not "
                             "return")
    path = Path(heads_dir) if heads_dir else shipped_heads_dir(target_name)
    if path is None:
        raise ModelLoadError(f"no Medusa heads ship for target {target_name!r}: train some with "
                             f"`specdec train medusa --target DIR --out HEADS` and pass --heads HEADS")
    return load_heads(path, lm)


@register("medusa")
def _load(env: ProposerEnv) -> ProposerFactory:
    """Heads from env.config.medusa_heads or the shipped ones, loaded once (loading gathers the
    draftable output rows). The proposer keeps no state between steps (observe learns nothing),
    so one serves every request and session."""
    heads = heads_for_target(env.target.name, env.config.medusa_heads, env.target)
    proposer = MedusaProposer(env.target, heads, env.config.medusa_tree, env.costs)
    return lambda: proposer
