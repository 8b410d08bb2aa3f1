"""Compare EAGLE drafts on prompts: per category, how often each draft's first drafted token is
the target's (alpha at k = 1) and how many tokens of a k-token chain the target would accept,
on the target's greedy answers (computed once, shared by every draft).

    python -m specdec.training.eagle_eval --eagle runs/eagle-a --eagle runs/eagle-b --per-category 2

The chains are computed as training's unrolled steps compute them (specdec.training.eagle:
step s at position j feeds the draft's own features after the true pairs up to j - s, with the
answer's tokens): on the path the target accepts, a chain's tokens are the answer's, so this is
what drafting computes there, in the draft's float32 weights (drafting runs float16 ones: equal
up to rounding). Greedy only; no timing (`specdec bench` measures speed). Evaluation only: the
prompts file is never used for training.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch

from specdec.decode import plain_generate
from specdec.backends.hf import CausalLM
from specdec.copy_tokens import CopyIndex, copy_candidates
from specdec.eagle import EagleDraft
from specdec.eagle_tree import DraftTree, draft_trees
from specdec.training.eagle import CachedSequence, first_positions, make_batch, pair_taps, unrolled_outputs
from specdec.types import StopConditions


def answer_sequence(target: CausalLM, prompt: list[int], answer: list[int],
                    tap_layers: Sequence[int] = ()) -> CachedSequence:
    """The target's features and top-1 over prompt + answer, as training caches them (rows j:
    pairs (f_j, t_{j+1}); with tap_layers, its residuals after those layers too); judged: the rows
    whose depth-1 prediction is an answer token from the second on (decoding drafts none before:
    the prefill gives the first)."""
    ids = prompt + answer
    out = target.forward(target.new_cache(1), torch.tensor([ids]), want_hidden=True)
    taps = pair_taps(target, ids, tap_layers) if tap_layers else None
    return CachedSequence(features=out.hidden[0, :-1].to(torch.float16).cpu(),
                          tokens=torch.tensor(ids[1:], dtype=torch.int32),
                          top1=out.logits[0, :-1].argmax(-1).to(torch.int32).cpu(),
                          eval_from=max(0, len(prompt) - 1), first=ids[0], taps=taps)


def with_taps(seq: CachedSequence, held: Sequence[int], wanted: Sequence[int]) -> CachedSequence:
    """seq, whose taps are the residuals after the layers `held` (in that order), with those of
    `wanted` only (a draft's tap_layers; none for a draft without)."""
    if not wanted:
        return replace(seq, taps=None)
    hidden = seq.features.shape[1]
    chunks = seq.taps.split(hidden, dim=-1)
    return replace(seq, taps=torch.cat([chunks[list(held).index(i)] for i in wanted], dim=-1))


def accepted_lengths(hits: torch.Tensor, judged: torch.Tensor) -> tuple[list[int], int]:
    """hits [k, W]: step s's prediction at position p + s right (s = 0..k-1); judged [W]: chains
    starting after the true pairs up to p that are counted -> (per depth d, the chains whose
    first d tokens are all right; chains counted)."""
    k, width = hits.shape
    ok = torch.ones(width, dtype=torch.bool)
    right = []
    for s in range(k):
        shifted = torch.zeros(width, dtype=torch.bool)
        shifted[: width - s] = hits[s, s:]  # chain from p: step s at p + s
        ok = ok & shifted
        right.append(int((ok & judged).sum()))
    return right, int(judged.sum())


@torch.inference_mode()
def chain_figures(draft: EagleDraft, seq: CachedSequence, k: int) -> tuple[list[int], int]:
    """(per depth d = 1..k, chains whose first d tokens the target accepts; chains counted), one
    chain from every answer position of seq. A context_vocab draft drafts its subset's tokens and
    those of the chain's committed context (t_0..t_{p+1} for the chain after pair p); a copy_token
    draft its subset's and each pair's copy candidate (on the true path: the chains counted)."""
    to_subset = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_subset[draft.token_ids] = torch.arange(len(draft.token_ids))
    batch = make_batch([seq], to_subset, draft.context_vocab)
    outs = unrolled_outputs(draft, batch.features.to(draft.dtype), batch.tokens, batch.valid, k, batch.previous,
                            batch.taps, batch.copies)
    if batch.vocab_ids is None and draft.copy_token:  # the subset and each pair's copy candidate (drafting's)
        truth = torch.full_like(batch.labels[0], -1)  # the target's next top-1, in or outside the subset
        truth[: len(seq.top1) - 1] = seq.top1[1:].long()
        hits = []
        for o in outs:
            ids, score = draft.copy_logits(o[0], batch.copies[0])
            scores = torch.cat([draft.subset_logits(o[0]), score.to(o.dtype)], dim=-1)
            table = torch.cat([draft.token_ids.expand(len(ids), -1), ids], dim=-1)
            hits.append((table.gather(-1, scores.argmax(-1, keepdim=True))[:, 0] == truth) & (truth >= 0))
        return accepted_lengths(torch.stack(hits), batch.judged[0])
    if batch.vocab_ids is None:
        picks = [draft.subset_logits(o[0]).argmax(-1) for o in outs]
    else:  # step s at j: the chain after pair j - s, whose context is t_0..t_{j-s+1}
        ids = [seq.first, *seq.tokens.tolist()]
        first_seen = first_positions(ids)
        seen = torch.tensor([-1 if draft.in_subset[t] else first_seen.get(t, len(ids))
                             for t in batch.vocab_ids.tolist()])  # [E]
        rows = draft.output[batch.vocab_ids].to(draft.dtype)
        reach = torch.arange(batch.tokens.shape[1])[:, None] + 1  # [W, 1]
        picks = [(o[0] @ rows.T).masked_fill(seen[None] > reach - s, float("-inf")).argmax(-1)
                 for s, o in enumerate(outs)]
    hits = torch.stack([(p == batch.labels[0]) & (batch.labels[0] >= 0) for p in picks])  # [k, W]
    return accepted_lengths(hits, batch.judged[0])


@dataclass(frozen=True)
class TreeShape:
    """A dynamic tree's shape (specdec.eagle_tree): depth, nodes sent, candidates per expansion."""

    depth: int
    nodes: int
    topk: int

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        try:
            depth, nodes, topk = (int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tree wants DEPTH,NODES,TOPK (e.g. 4,32,8), not {text!r}") from None
        if not (depth >= 1 and nodes >= depth and topk >= 1):
            raise argparse.ArgumentTypeError(f"--tree {text}: need depth >= 1, nodes >= depth, topk >= 1")
        return cls(depth, nodes, topk)

    def __str__(self) -> str:
        return f"depth {self.depth}, {self.nodes} nodes, top-{self.topk}"


def tree_accepted(tree: DraftTree, following: Sequence[int]) -> int:
    """How many of the tree's tokens greedy verification accepts where the target's next tokens
    are `following`: the longest path from the root whose tokens are theirs."""
    accepted, at = 0, -1
    for want in following:
        nxt = [i for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents)) if p == at and t == want]
        if not nxt:
            break
        accepted, at = accepted + 1, nxt[0]
    return accepted


def copy_index(ids: Sequence[int]) -> CopyIndex:
    index = CopyIndex()
    index.extend(ids)
    return index


@torch.inference_mode()
def tree_figures(draft: EagleDraft, seq: CachedSequence, shape: TreeShape, rows: int = 32) -> tuple[int, int]:
    """(tokens accepted, trees counted): a dynamic tree drafted, as decoding drafts it, after every
    answer position of seq that chain_figures counts (committed t_0..t_{L-1}, L from the answer's
    second token on), judged against the answer's next tokens. Each tree costs one target
    forward, so 1 + accepted / trees is the tree's tau."""
    ids = [seq.first, *seq.tokens.tolist()]
    pairs = len(ids) - 1  # (f_j, t_{j+1}) for j = 0..len - 2
    whole = draft.new_cache(1)
    out = draft.extend(whole, seq.features[None].to(draft.dtype), torch.tensor([ids[1:]]),
                       previous_ids=torch.tensor([ids[:-1]]), taps=None if seq.taps is None else seq.taps[None],
                       copy_ids=torch.tensor([copy_candidates(ids)[1:]]) if draft.copy_token else None)[0]  # [pairs, H]: out[j] = f^_{j+1}
    starts = list(range(seq.eval_from + 2, len(ids)))
    accepted = 0
    for at in range(0, len(starts), rows):
        part = starts[at: at + rows]
        cache = draft.new_cache(len(part))
        cache.load_layer_kv([k.expand(len(part), -1, -1, -1).contiguous() for k, _ in whole.layer_kv()],
                            [v.expand(len(part), -1, -1, -1).contiguous() for _, v in whole.layer_kv()],
                            torch.arange(pairs)[None, :] < torch.tensor([L - 1 for L in part])[:, None])
        trees = draft_trees(draft, cache, out[[L - 2 for L in part]], torch.tensor([ids[L - 1] for L in part]),
                            [shape.depth] * len(part), [shape.nodes] * len(part), shape.topk,
                            draft.context_tokens([ids[:L] for L in part]),
                            [copy_index(ids[:L]) for L in part] if draft.copy_token else None)
        accepted += sum(tree_accepted(t, ids[L: L + shape.depth]) for t, L in zip(trees, part))
    return accepted, len(starts)


def compare(target: CausalLM, drafts: dict[str, EagleDraft], prompts: Sequence[tuple[str, list[int]]],
            max_new_tokens: int, k: int = 3, tree: Optional[TreeShape] = None) -> dict:
    """-> {draft name: {category: {"alpha": depth-1 agreement, "accepted": mean tokens of a
    k-chain accepted, "chains": n[, "tree_tau": 1 + mean tokens of a dynamic tree accepted]}}},
    categories plus "all"."""
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
    sums = {name: defaultdict(lambda: [[0] * k, 0, 0, 0]) for name in drafts}
    layers = sorted({i for draft in drafts.values() for i in draft.tap_layers})
    for cat, ids in prompts:
        answer = list(plain_generate(target, [ids], stop=stop)[0].token_ids)
        whole = answer_sequence(target, ids, answer, layers)
        for name, draft in drafts.items():
            seq = with_taps(whole, layers, draft.tap_layers)
            right, n = chain_figures(draft, seq, k)
            in_trees, trees = tree_figures(draft, seq, tree) if tree is not None else (0, 0)
            for key in (cat, "all"):
                acc = sums[name][key]
                acc[0] = [a + b for a, b in zip(acc[0], right)]
                acc[1] += n
                acc[2] += in_trees
                acc[3] += trees
    table = {}
    for name, per in sums.items():
        table[name] = {}
        for cat, (r, n, in_trees, trees) in sorted(per.items()):
            row = {"alpha": round(r[0] / max(n, 1), 3), "accepted": round(sum(r) / max(n, 1), 3), "chains": n}
            if tree is not None:
                row["tree_tau"] = round(1 + in_trees / max(trees, 1), 3)
            table[name][cat] = row
    return table


def format_table(table: dict, k: int, tree: Optional[TreeShape] = None) -> str:
    cats = sorted({c for per in table.values() for c in per}, key=lambda c: (c == "all", c))
    what = f"alpha at k = 1 / tokens of a {k}-token chain accepted"
    if tree is not None:
        what += f" / tau of a dynamic tree ({tree})"
    lines = [what, "", "| draft | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]

    def cell(row: dict) -> str:
        text = f"{row['alpha']:.2f} / {row['accepted']:.2f}"
        return text + (f" / {row['tree_tau']:.2f}" if "tree_tau" in row else "")

    for name, per in table.items():
        lines.append(f"| {name} | " + " | ".join(cell(per[c]) if c in per else "-" for c in cats) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from specdec.eagle import load_eagle, shipped_eagle_path
    from specdec.models import DEFAULT_TARGET, format_prompt, load_model
    from specdec.prompt_sets import DEV_PROMPTS, read_prompt_rows
    from specdec.training.selfdistill import training_kind_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle", action="append", default=None,
                    help="an EAGLE directory (repeat to compare several; default: the shipped draft)")
    ap.add_argument("--prompts", default=str(DEV_PROMPTS),
                    help="JSONL with {category, turns: [text, ...]} per line (default: the shipped dev set)")
    ap.add_argument("--training-kinds", action="store_true",
                    help="instead of --prompts: prompts of the training data's kinds that it holds no answer to "
                         "(real instructions after those data/real answered, prompts drawn again from the templates)")
    ap.add_argument("--per-category", type=int, default=2, help="the first N prompts of each category")
    ap.add_argument("--target", default=None)
    ap.add_argument("--backend", default="fast")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3, help="chain length (default 3)")
    ap.add_argument("--tree", type=TreeShape.parse, default=None, metavar="DEPTH,NODES,TOPK",
                    help="also the tau of a dynamic tree of this shape (what a target that verifies it at a "
                         "chain's cost, a GPU, gains per forward), e.g. 4,32,8")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    target = load_model(args.target, backend=args.backend)
    dirs = args.eagle or [str(shipped_eagle_path(DEFAULT_TARGET))]
    drafts = {d: load_eagle(Path(d), target.lm).float() for d in dirs}
    if args.training_kinds:
        texts = [(p.category, p.text) for p in training_kind_prompts(args.per_category)]
    else:
        picked: dict[str, list] = defaultdict(list)
        for r in read_prompt_rows(args.prompts):
            if len(picked[r["category"]]) < args.per_category:
                picked[r["category"]].append(r)
        texts = [(cat, r["turns"][0]) for cat, rs in picked.items() for r in rs]
    prompts = [(cat, format_prompt(target.tokenizer, text)) for cat, text in texts]
    table = compare(target.lm, drafts, prompts, args.max_new_tokens, args.k, args.tree)
    print(format_table(table, args.k, args.tree))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
