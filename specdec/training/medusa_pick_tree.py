"""Pick a Medusa heads directory's default tree from measured τ (end-to-end, from the training
run's tree timing) and the measured verify-cost curve v(n) of this CPU: argmax τ / v(nodes + 1).
For a machine shared with other jobs, where wall-clock tokens/s of the timing run are noise
(they were for the shipped heads: load ~10 on 2 cores), while τ is exact and v is a ratio of
interleaved timings.

    python -m specdec.training.medusa_pick_tree HEADS_DIR

HEADS_DIR must come from `specdec train medusa --pick-tree N` (its notes hold the timed τ).
"""
from __future__ import annotations

import sys
from dataclasses import replace

from specdec.costmodel import measure_verify_cost, verify_cost_at
from specdec.medusa_heads import load_heads, read_config, save_heads
from specdec.models import load_model
from specdec.training.medusa import tree_candidates


def main(out: str) -> None:
    target = load_model()
    cfg = read_config(out)
    table = cfg.notes["tree_selection"]["table"]
    cands = tree_candidates(cfg.accuracy, cfg.num_heads)
    sizes = sorted({len(p) + 1 for p in cands.values()} | {1})
    v = measure_verify_cost(target.lm, ks=sizes, context_len=256, repeats=5)
    score = {name: table[name]["tau"] / verify_cost_at(v, len(paths) + 1) for name, paths in cands.items()}
    for name in cands:
        print(f"{name:9s} nodes {len(cands[name]):2d} tau {table[name]['tau']:.2f} v {verify_cost_at(v, len(cands[name]) + 1):.2f} "
              f"predicted x{score[name]:.2f}")
    best = max(score, key=score.get)
    print("v:", {k: round(x, 2) for k, x in v.items()}, "best:", best)
    heads = load_heads(out, target.lm)
    sel = dict(cfg.notes["tree_selection"])
    sel.update(chosen=best, rule="argmax measured tau / measured v(nodes + 1); wall-clock tok/s too noisy under load",
               verify_cost=v, predicted_speedup={k: round(x, 3) for k, x in score.items()})
    save_heads(heads, out, replace(cfg, default_tree=tuple(cands[best]), notes={**cfg.notes, "tree_selection": sel}))


if __name__ == "__main__":
    main(sys.argv[1])
