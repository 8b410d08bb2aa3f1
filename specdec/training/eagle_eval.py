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
from pathlib import Path
from typing import Optional, Sequence

import torch

from specdec.decode import plain_generate
from specdec.backends.hf import CausalLM
from specdec.eagle import EagleDraft
from specdec.training.eagle import CachedSequence, make_batch, unrolled_outputs
from specdec.types import StopConditions


def answer_sequence(target: CausalLM, prompt: list[int], answer: list[int]) -> CachedSequence:
    """The target's features and top-1 over prompt + answer, as training caches them (rows j:
    pairs (f_j, t_{j+1})); judged: the rows whose depth-1 prediction is an answer token from the
    second on (decoding drafts none before: the prefill gives the first)."""
    ids = prompt + answer
    out = target.forward(target.new_cache(1), torch.tensor([ids]), want_hidden=True)
    return CachedSequence(features=out.hidden[0, :-1].to(torch.float16).cpu(),
                          tokens=torch.tensor(ids[1:], dtype=torch.int32),
                          top1=out.logits[0, :-1].argmax(-1).to(torch.int32).cpu(),
                          eval_from=max(0, len(prompt) - 1), first=ids[0])


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
    chain from every answer position of seq."""
    to_subset = torch.full((draft.vocab_size,), -1, dtype=torch.long)
    to_subset[draft.token_ids] = torch.arange(len(draft.token_ids))
    batch = make_batch([seq], to_subset)
    outs = unrolled_outputs(draft, batch.features.to(draft.dtype), batch.tokens, batch.valid, k, batch.previous)
    hits = torch.stack([(draft.subset_logits(o[0]).argmax(-1) == batch.labels[0]) & (batch.labels[0] >= 0)
                        for o in outs])  # [k, W]
    return accepted_lengths(hits, batch.judged[0])


def compare(target: CausalLM, drafts: dict[str, EagleDraft], prompts: Sequence[tuple[str, list[int]]],
            max_new_tokens: int, k: int = 3) -> dict:
    """-> {draft name: {category: {"alpha": depth-1 agreement, "accepted": mean tokens of a
    k-chain accepted, "chains": n}}}, categories plus "all"."""
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
    sums = {name: defaultdict(lambda: [[0] * k, 0]) for name in drafts}
    for cat, ids in prompts:
        answer = list(plain_generate(target, [ids], stop=stop)[0].token_ids)
        seq = answer_sequence(target, ids, answer)
        for name, draft in drafts.items():
            right, n = chain_figures(draft, seq, k)
            for key in (cat, "all"):
                acc = sums[name][key]
                acc[0] = [a + b for a, b in zip(acc[0], right)]
                acc[1] += n
    return {name: {cat: {"alpha": round(r[0] / max(n, 1), 3), "accepted": round(sum(r) / max(n, 1), 3),
                         "chains": n} for cat, (r, n) in sorted(per.items())} for name, per in sums.items()}


def format_table(table: dict, k: int) -> str:
    cats = sorted({c for per in table.values() for c in per}, key=lambda c: (c == "all", c))
    lines = [f"alpha at k = 1 / tokens of a {k}-token chain accepted", "",
             "| draft | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for name, per in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{per[c]['alpha']:.2f} / {per[c]['accepted']:.2f}" if c in per
                                               else "-" for c in cats) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from specdec.eagle import load_eagle, shipped_eagle_path
    from specdec.models import DEFAULT_TARGET, format_prompt, load_model
    from specdec.prompt_sets import DEV_PROMPTS, read_prompt_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle", action="append", default=None,
                    help="an EAGLE directory (repeat to compare several; default: the shipped draft)")
    ap.add_argument("--prompts", default=str(DEV_PROMPTS),
                    help="JSONL with {category, turns: [text, ...]} per line (default: the shipped dev set)")
    ap.add_argument("--per-category", type=int, default=2, help="the first N prompts of each category")
    ap.add_argument("--target", default=None)
    ap.add_argument("--backend", default="fast")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=3, help="chain length (default 3)")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    target = load_model(args.target, backend=args.backend)
    dirs = args.eagle or [str(shipped_eagle_path(DEFAULT_TARGET))]
    drafts = {d: load_eagle(Path(d), target.lm).float() for d in dirs}
    picked: dict[str, list] = defaultdict(list)
    for r in read_prompt_rows(args.prompts):
        if len(picked[r["category"]]) < args.per_category:
            picked[r["category"]].append(r)
    prompts = [(cat, format_prompt(target.tokenizer, r["turns"][0])) for cat, rs in picked.items() for r in rs]
    table = compare(target.lm, drafts, prompts, args.max_new_tokens, args.k)
    print(format_table(table, args.k))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
