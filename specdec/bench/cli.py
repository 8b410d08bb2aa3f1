"""`specdec bench` and `specdec cost-curve`: argument parsing only (the work is in methods.py and
specdec/costmodel.py)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec.backends import BACKENDS as _BACKENDS
from specdec.errors import SpecdecError



def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_ks(text: str) -> list[int]:
    """'1-8,12,16' -> [1, 2, ..., 8, 12, 16]."""
    ks: set[int] = set()
    try:
        for part in _csv(text):
            lo, _, hi = part.partition("-")
            ks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SpecdecError(f"bad --ks {text!r}: use e.g. 1-16,24,32") from None
    if not ks or min(ks) < 1:
        raise SpecdecError(f"bad --ks {text!r}: block sizes must be >= 1")
    return sorted(ks)


def add_bench(sub: argparse._SubParsersAction) -> None:
    from specdec.prompt_sets import DEV_PROMPTS

    p = sub.add_parser("bench", help="benchmark every method against transformers' generate, assisted "
                                     "generation and prompt lookup; write a Markdown table and a plot")
    p.add_argument("--out", default="bench/results", help="output folder (default bench/results)")
    p.add_argument("--prompts", default=str(DEV_PROMPTS),
                   help="jsonl prompt file (id, category, turns); default: the dev set shipped in the package")
    p.add_argument("--per-category", type=int, default=5, help="prompts per category, seeded sample (default 5)")
    p.add_argument("--all", action="store_true", help="every prompt in the file (overrides --per-category)")
    p.add_argument("--categories", default="", help="comma-separated categories (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--k", default="auto",
                   help="tokens drafted per step, or auto (default: specdec's cost-aware schedule; HF assisted "
                        "starts at 4 and adapts)")
    p.add_argument("--methods", default="",
                   help="comma-separated methods (default: every available: hf-generate, hf-assisted, "
                        "hf-prompt-lookup, every specdec method, and auto: what `specdec generate` runs by default)")
    p.add_argument("--backend", default="auto",
                   help=f"specdec backend(s) to run its methods on, comma-separated: {', '.join(_BACKENDS)} "
                        "(default auto: the one `specdec generate` picks, measured once per machine; several: each "
                        "method once per backend, e.g. plain@hf)")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--eagle", default=None,
                   help="EAGLE draft directory for specdec eagle (default: the one shipped for the target)")
    p.add_argument("--eagle-depth", default="auto", choices=("auto", "k"),
                   help="EAGLE chains as deep as the draft's confidence pays for, at most k (auto), or k tokens")
    p.add_argument("--draft", default="shipped",
                   help="draft for specdec draft and HF assisted: shipped (default: the draft shipped for the "
                        "target, early-exit:4 if none), a model or specdec draft directory, or early-exit:N "
                        "(the target's first N layers, untrained)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--verify-cost", default="measured", choices=("measured", "flat"),
                   help="specdec's methods choose chains, trees and k by this machine's measured verify cost "
                        "(default), or as where a forward over up to 64 tokens costs one (flat: a GPU at batch 1; "
                        "tau and alpha are then that device's, tokens/s still this machine's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt sample")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new prompt after S seconds; the table covers the prompts done")
    p.set_defaults(func=_cmd_bench)


def _k_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise SpecdecError(f"--k must be a positive integer or auto, got {text!r}") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench.methods import BenchConfig, run_bench

    backends = _csv(args.backend)
    bad = [b for b in backends if b not in _BACKENDS]
    if bad or not backends:
        raise SpecdecError(f"unknown backend(s) {bad}; choose from {', '.join(_BACKENDS)}")
    if not Path(args.prompts).is_file():
        raise SpecdecError(f"prompt file not found: {args.prompts}")
    config = BenchConfig(
        target=args.target, draft=args.draft, eagle=args.eagle, eagle_depth=args.eagle_depth, prompts=Path(args.prompts),
        per_category=0 if args.all else args.per_category, categories=_csv(args.categories),
        max_new_tokens=args.max_new_tokens, k=_k_arg(args.k), methods=_csv(args.methods), backends=backends,
        out=Path(args.out), seed=args.seed, threads=args.threads, device=args.device,
        time_budget_s=args.time_budget, verify_cost=args.verify_cost,
    )
    command = "specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] \
        else "specdec bench"
    run_bench(config, command=command, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print((Path(args.out) / "results.md").read_text())
    print(f"wrote {args.out}/results.md, {args.out}/speedup.png, {args.out}/results.json", file=sys.stderr)
    return 0


def add_cost_curve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cost-curve", help="measure v(k) = time of a target forward over k new tokens / over 1")
    p.add_argument("--ks", default="1-16,20,24,32,48,64", help="block sizes, e.g. 1-64 (default 1-16,20,24,32,48,64)")
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per block size (median; default 5)")
    p.add_argument("--backend", default="auto", choices=list(_BACKENDS), help="how the target runs")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--cpu-time", action="store_true",
                   help="time CPU time of the calling thread instead of wall time (use with --threads 1 on a "
                        "shared machine)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write {k: v(k)} here")
    p.add_argument("--refresh", action="store_true",
                   help="instead of the full curve, measure again the figures that `specdec generate` keeps in the "
                        "cache folder for this machine, target, backend and thread count (v(k) for --k auto and "
                        "--tree auto; the shipped draft's cost c) and replace them")
    p.set_defaults(func=_cmd_cost_curve)


def _refresh_costs(lm, args: argparse.Namespace) -> int:
    import torch

    from specdec.costmodel import format_curve
    from specdec.engine import Engine, EngineConfig, default_cost_store
    from specdec.models import LoadedModel

    config = EngineConfig(target=args.target, backend=args.backend)
    costs = default_cost_store(config, refresh=True,
                               notify=lambda line: print(f"specdec: {line}", file=sys.stderr, flush=True))
    engine = Engine.from_models(LoadedModel(lm=lm, tokenizer=None, path=args.target or lm.name), config=config,
                                costs=costs)
    print(f"# {lm.name}, backend {args.backend}, {torch.get_num_threads()} threads; kept in {costs.directory}")
    print(format_curve(costs.verify_cost(lm)))
    try:
        print(f"draft cost c = {costs.draft_cost(engine.require_draft().lm, lm):.3f} (shipped draft)")
    except SpecdecError as exc:
        print(f"no draft cost: {exc}")
    return 0


def _cmd_cost_curve(args: argparse.Namespace) -> int:
    import torch

    from specdec.costmodel import measure_forward_times
    from specdec.models import load_model

    ks = parse_ks(args.ks)
    if args.repeats < 1 or args.context < 1:
        raise SpecdecError("--repeats and --context must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.target, device=args.device, backend=args.backend).lm
    if args.refresh:
        return _refresh_costs(lm, args)
    curve: dict[int, float] = {}

    def record(k: int, v: float) -> None:  # v(k) against the 1-token forwards timed alongside k
        curve[k] = 1.0 if k == 1 else v
        print(f"k={k:<3d} v={curve[k]:.2f}", file=sys.stderr, flush=True)

    times, t1 = measure_forward_times(lm, ks, context_len=args.context, repeats=args.repeats, progress=record,
                                      cpu_time=args.cpu_time)
    print(f"# {lm.name}, backend {args.backend}, {torch.get_num_threads()} threads, context {args.context}, "
          f"1-token forward {t1 * 1e3:.1f} ms ({'CPU' if args.cpu_time else 'wall'} time)")
    print("k\tv(k)\tms")
    for k in ks:
        print(f"{k}\t{curve[k]:.2f}\t{times[k] * 1e3:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "context": args.context,
                                               "clock": "cpu" if args.cpu_time else "wall",
                                               "one_token_ms": t1 * 1e3, "v": {str(k): curve[k] for k in ks}}))
    return 0
