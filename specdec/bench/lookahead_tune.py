"""Measure Lookahead decoding on the real target: the verify-cost curve v(q), then tau and
tokens/s per category for a few (W, N, G) against plain greedy decoding, outputs checked equal.

    nice -n 10 python -m specdec.bench.lookahead_tune --threads 1 --vq 2,4,8,12,16,24,32 \\
        --configs 4,3,2 5,4,2 --categories chat,code --per-category 2 --max-new-tokens 64
    nice -n 10 python -m specdec.bench.lookahead_tune --threads 1 --vq '' --tau-only --configs 5,4,2 \\
        --categories chat,code,translation,summarization,qa,math,rag

v(q) is the *minimum* over interleaved repeats of a forward over q new tokens against a warm
~200-token context, divided by the same for 1 token. Tokens/s are end-to-end (prefill
included) and each method runs right after plain on the same prompt. On a machine shared with
other jobs, use --threads 1: times are then the process's CPU time, which time-slicing does not
inflate (wall-clock ratios on an oversubscribed 2-core machine are noise).
"pred" is tau / v(mean q): the speedup the cost curve predicts from the measured tau.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.costmodel import verify_cost_at
from specdec.decode import plain_generate, speculative_generate
from specdec.models import format_prompt, load_model
from specdec.prompt_sets import read_prompt_rows
from specdec.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdec.types import StopConditions



def min_forward_cost(lm, qs, context_len=200, repeats=7, seed=0, clock=time.perf_counter):
    """({q: min time of a q-token forward / min time of a 1-token forward}, min 1-token time)."""
    gen = torch.Generator().manual_seed(seed)
    cache = lm.new_cache(1)
    lm.prefill(cache, [torch.randint(0, lm.vocab_size, (context_len,), generator=gen).tolist()])
    best = {q: float("inf") for q in set(qs) | {1}}
    for _ in range(repeats):
        for q in sorted(best):
            ids = torch.randint(0, lm.vocab_size, (1, q), generator=gen)
            t0 = clock()
            lm.forward(cache, ids).logits.sum().item()
            best[q] = min(best[q], clock() - t0)
            cache.keep_last(torch.zeros(1, q, dtype=torch.bool))
    return {q: best[q] / best[1] for q in sorted(best)}, best[1]


def load_prompts(tokenizer, categories, per_category):
    rows = read_prompt_rows()
    out = []
    for cat in categories:
        picked = [r for r in rows if r["category"] == cat][:per_category]
        out += [(cat, format_prompt(tokenizer, r["turns"][0])) for r in picked]
    return out


def tau_grid(lm, configs, prompts, stop, k) -> None:
    """tau per category for each config, every prompt decoded in one batch; outputs checked
    against plain greedy (also batched)."""
    batch = [ids for _, ids in prompts]
    plain = plain_generate(lm, batch, stop=stop)
    cats = list(dict.fromkeys(cat for cat, _ in prompts))
    print(f"{'config':22s} " + " ".join(f"{c[:8]:>8s}" for c in cats) + "      all  same  mean q")
    for cfg in configs:
        t0 = time.perf_counter()
        got = speculative_generate(lm, LookaheadProposer(cfg), batch, stop=stop, k=k)
        per_cat = []
        for c in cats:
            rows = [g for (cat, _), g in zip(prompts, got) if cat == c]
            per_cat.append(sum(g.stats.emitted for g in rows) / sum(g.stats.target_forwards for g in rows))
        total = sum(g.stats.emitted for g in got) / sum(g.stats.target_forwards for g in got)
        same = sum(g.token_ids == p.token_ids for g, p in zip(got, plain))
        m = cfg.window * (cfg.ngram - 1) - 1
        q_mean = 1 + m + sum(g.stats.drafted for g in got) / max(1, sum(g.stats.target_forwards - 1 for g in got))
        name = f"W={cfg.window},N={cfg.ngram},G={cfg.guess},ctx={int(cfg.pool_from_context)}"
        print(f"{name:22s} " + " ".join(f"{t:8.2f}" for t in per_cat) + f" {total:8.2f}  {same}/{len(got)}"
              f"  q~{q_mean:.1f}  ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vq", default="1,2,4,8,12,16,24,32", help="q values for the cost curve ('' skips it)")
    ap.add_argument("--configs", nargs="+", default=["4,3,2"], help="W,N,G triples, optionally ,ctx0 to disable "
                    "context pooling")
    ap.add_argument("--categories", default="chat,code")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="the loop's depth cap (>= N - 1)")
    ap.add_argument("--tau-only", action="store_true", help="run all prompts as one batch and report tau only "
                    "(tau does not depend on batching or machine load; far cheaper than timed batch-1 runs)")
    ap.add_argument("--backend", default="hf", help="target backend (specdec.models.BACKENDS)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 wastes least "
                    "CPU on a machine shared with other jobs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # With one thread, CPU time is what a step costs however busy the machine is; with more,
    # threads waiting on each other would be counted too, so wall time is used.
    clock = time.process_time if args.threads == 1 else time.perf_counter
    clock_name = "CPU time, 1 thread" if args.threads == 1 else "wall time"

    model = load_model(backend=args.backend)
    lm = model.lm
    curve = None
    if args.vq:
        curve, t1 = min_forward_cost(lm, [int(x) for x in args.vq.split(",")], clock=clock)
        print(f"v(q) by {clock_name}; 1-token forward {t1 * 1000:.1f} ms (min over repeats, 200-token context):")
        print("  " + "  ".join(f"v({q})={v:.2f}" for q, v in curve.items()), flush=True)

    configs = []
    for c in args.configs:
        parts = c.split(",")
        w, n, g = (int(x) for x in parts[:3])
        configs.append(LookaheadConfig(window=w, ngram=n, guess=g, pool_from_context=not (parts[3:] == ["ctx0"])))
    stop = StopConditions(max_new_tokens=args.max_new_tokens, eos_token_ids=lm.eos_token_ids)
    prompts = load_prompts(model.tokenizer, args.categories.split(","), args.per_category)
    if args.tau_only:
        tau_grid(lm, configs, prompts, stop, args.k)
        return
    table: dict[tuple, dict[str, list]] = {}
    for cat, ids in prompts:
        t0 = clock()
        [plain] = plain_generate(lm, [ids], stop=stop)
        plain_speed = plain.stats.emitted / (clock() - t0)  # tokens per second of `clock`
        for cfg in configs:
            t0 = clock()
            [got] = speculative_generate(lm, LookaheadProposer(cfg), [ids], stop=stop, k=args.k)
            speed = got.stats.emitted / (clock() - t0)
            same = got.token_ids == plain.token_ids
            s = got.stats
            m = cfg.window * (cfg.ngram - 1) - 1
            q_mean = 1 + m + s.drafted / max(1, s.target_forwards - 1)
            row = table.setdefault((cfg, cat), {"tau": [], "ratio": [], "q": [], "same": []})
            row["tau"].append(s.tau)
            row["ratio"].append(speed / plain_speed)
            row["q"].append(q_mean)
            row["same"].append(same)
            print(f"{cat:13s} W={cfg.window} N={cfg.ngram} G={cfg.guess} ctx={int(cfg.pool_from_context)} "
                  f"tau {s.tau:.2f} q~{q_mean:.1f} {speed:.1f} tok/s vs plain {plain_speed:.1f} "
                  f"({speed / plain_speed:.2f}x, {clock_name}; wall {s.tokens_per_s:.1f} vs "
                  f"{plain.stats.tokens_per_s:.1f}) same={same}", flush=True)

    print("\nsummary (mean over prompts):")
    print(f"{'config':22s} {'category':13s} {'tau':>5s} {'q':>5s} {'measured':>9s} {'pred':>6s} same")
    for (cfg, cat), row in table.items():
        tau = sum(row["tau"]) / len(row["tau"])
        q = sum(row["q"]) / len(row["q"])
        pred = f"{tau / verify_cost_at(curve, round(q)):.2f}x" if curve else "-"
        name = f"W={cfg.window},N={cfg.ngram},G={cfg.guess},ctx={int(cfg.pool_from_context)}"
        print(f"{name:22s} {cat:13s} {tau:5.2f} {q:5.1f} {sum(row['ratio']) / len(row['ratio']):8.2f}x "
              f"{pred:>6s} {all(row['same'])}")


if __name__ == "__main__":
    main()
