"""Evaluate Medusa heads on prompts: per-head top-1 accuracy against the target's greedy
continuation, and τ / tokens/s of `--method medusa` against plain decoding (interleaved per
prompt, greedy, batch 1; outputs checked identical).

    python -m specdec.training.medusa_eval --per-category 2

Evaluation only: the prompts file is never used for training or for choosing the tree.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from specdec.costmodel import thread_cpu_time_applies, timer
from specdec.decode import plain_generate, speculative_generate
from specdec.backends.hf import CausalLM
from specdec.medusa_heads import MedusaHeads
from specdec.prompt_sets import DEV_PROMPTS, read_prompt_rows
from specdec.training.medusa import head_labels
from specdec.types import StopConditions


@torch.inference_mode()
def head_top1(target: CausalLM, heads: MedusaHeads, prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    """Per head: (hits, counted) of the head's top-1 draft against the greedy answer's tokens."""
    ids = prompt + answer
    out = target.forward(target.new_cache(1), torch.tensor([ids]), want_hidden=True)
    start = len(prompt)
    hidden = out.hidden[0, start - 1 : len(ids) - 1]  # [n, hidden]
    greedy = out.logits[0, start - 1 : len(ids) - 1].argmax(-1)  # [n]
    labels = head_labels(torch.tensor(answer), greedy, heads.config.num_heads)  # [n, K]
    weight = target.model.get_output_embeddings().weight
    if heads.vocab_ids is not None:
        weight = weight[heads.vocab_ids]
    top = (heads.states(hidden) @ weight.T).argmax(-1)  # [n, K]
    if heads.vocab_ids is not None:
        top = heads.vocab_ids[top]
    ok = labels >= 0
    return ((top == labels) & ok).sum(0).tolist(), ok.sum(0).tolist()


def evaluate(target: CausalLM, proposer, heads: MedusaHeads, prompts: list[tuple[str, list[int]]],
             max_new_tokens: int, log=print) -> dict:
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
    per_cat: dict[str, dict] = defaultdict(lambda: {"plain_s": 0.0, "medusa_s": 0.0, "tokens": 0, "forwards": 0,
                                                    "hits": None, "counted": None, "identical": 0, "prompts": 0})
    clock = timer(thread_cpu_time_applies(target))  # thread CPU time on one CPU thread, else wall time
    for cat, ids in prompts:
        t0 = clock()
        plain = plain_generate(target, [ids], stop=stop)[0]
        t1 = clock()
        med = speculative_generate(target, proposer, [ids], stop=stop, k=heads.config.num_heads)[0]
        t2 = clock()
        hits, counted = head_top1(target, heads, ids, list(plain.token_ids))
        row = per_cat[cat]
        row["plain_s"] += t1 - t0
        row["medusa_s"] += t2 - t1
        row["tokens"] += med.stats.emitted
        row["forwards"] += med.stats.target_forwards
        row["identical"] += int(med.token_ids == plain.token_ids)
        row["prompts"] += 1
        row["hits"] = hits if row["hits"] is None else [a + b for a, b in zip(row["hits"], hits)]
        row["counted"] = counted if row["counted"] is None else [a + b for a, b in zip(row["counted"], counted)]
        log(f"{cat:14s} tau {med.stats.tau:.2f}  plain {plain.stats.emitted / (t1 - t0):5.1f} tok/s  "
            f"medusa {med.stats.emitted / (t2 - t1):5.1f} tok/s  identical {med.token_ids == plain.token_ids}")
    table = {}
    for cat, r in sorted(per_cat.items()):
        table[cat] = {"prompts": r["prompts"], "tau": round(r["tokens"] / max(r["forwards"], 1), 2),
                      "speedup": round(r["plain_s"] / r["medusa_s"], 2),
                      "plain_tok_s": round(r["tokens"] / r["plain_s"], 1),
                      "medusa_tok_s": round(r["tokens"] / r["medusa_s"], 1),
                      "head_top1": [round(h / max(c, 1), 3) for h, c in zip(r["hits"], r["counted"])],
                      "identical": f"{r['identical']}/{r['prompts']}"}
    tot = {k: sum(r[k] for r in per_cat.values()) for k in ("plain_s", "medusa_s", "tokens", "forwards")}
    hits = [sum(col) for col in zip(*(r["hits"] for r in per_cat.values()))]
    counted = [sum(col) for col in zip(*(r["counted"] for r in per_cat.values()))]
    table["all"] = {"prompts": len(prompts), "tau": round(tot["tokens"] / max(tot["forwards"], 1), 2),
                    "speedup": round(tot["plain_s"] / tot["medusa_s"], 2),
                    "plain_tok_s": round(tot["tokens"] / tot["plain_s"], 1),
                    "medusa_tok_s": round(tot["tokens"] / tot["medusa_s"], 1),
                    "head_top1": [round(h / max(c, 1), 3) for h, c in zip(hits, counted)],
                    "identical": f"{sum(r['identical'] for r in per_cat.values())}/{len(prompts)}"}
    return table


def format_table(table: dict) -> str:
    lines = ["| category | prompts | tau | plain tok/s | medusa tok/s | speedup | head top-1 (1..K) | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for cat, r in table.items():
        lines.append(f"| {cat} | {r['prompts']} | {r['tau']} | {r['plain_tok_s']} | {r['medusa_tok_s']} | "
                     f"{r['speedup']}x | {' / '.join(f'{a:.2f}' for a in r['head_top1'])} | {r['identical']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from specdec.medusa_heads import load_heads, shipped_heads_dir
    from specdec.models import DEFAULT_TARGET, format_prompt, load_model
    from specdec.proposers.medusa import MedusaProposer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(DEV_PROMPTS),
                    help="JSONL with {category, turns: [text, ...]} per line (default: the shipped dev set)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--heads", default=None, help="heads directory (default: the shipped heads)")
    ap.add_argument("--tree", default=None, help="tree setting (default: auto)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    target = load_model(args.target, backend=args.backend)
    heads = load_heads(args.heads or shipped_heads_dir(DEFAULT_TARGET), target.lm)
    rows = read_prompt_rows(args.prompts)
    picked: dict[str, list] = defaultdict(list)
    for r in rows:
        if len(picked[r["category"]]) < args.per_category:
            picked[r["category"]].append(r)
    prompts = [(cat, format_prompt(target.tokenizer, r["turns"][0])[-384:]) for cat, rs in picked.items() for r in rs]
    proposer = MedusaProposer(target.lm, heads, args.tree)
    print(f"tree: {len(proposer.tree.paths)} nodes {list(proposer.tree.paths)}; backend {args.backend}")
    table = evaluate(target.lm, proposer, heads, prompts, args.max_new_tokens)
    print(format_table(table))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
