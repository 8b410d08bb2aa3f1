"""`specdec` command line. User errors print one line and exit 2; never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from specdec.errors import SpecdecError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from specdec.engine import METHODS

    p = sub.add_parser("generate", help="decode one prompt and print the text and a stats line")
    p.add_argument("prompt", help="the user prompt (wrapped in the chat template unless --no-chat)")
    p.add_argument("--method", default="plain", choices=list(METHODS))
    p.add_argument("--k", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument("--adaptive-k", action="store_true", help="grow k on full acceptance, shrink on early rejection")
    p.add_argument("--k-max", type=int, default=16, help="upper bound for --adaptive-k")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft model directory for --method draft")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--backend", default="hf", choices=["hf", "fast", "fast-bf16"],
                   help="how the target runs: hf (transformers, any model), fast (specdec's Llama forward, same "
                        "outputs, faster on CPU), fast-bf16 (LOSSY: bfloat16 weights)")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec.decode import KSchedule
    from specdec.engine import Engine, EngineConfig
    from specdec.types import SamplingParams, StopConditions

    # Validate everything cheap before loading models.
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stop = StopConditions(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))
    k = KSchedule(k=args.k, adaptive=args.adaptive_k, k_max=max(args.k_max, args.k))
    if not args.prompt.strip():
        raise SpecdecError("the prompt is empty")
    if args.method == "draft" and args.draft is None:
        raise SpecdecError("--method draft needs --draft DIR (a model sharing the target's vocabulary)")
    engine = Engine(EngineConfig(target=args.target, draft=args.draft if args.method == "draft" else None,
                                 backend=args.backend))
    out = engine.complete(args.prompt, method=args.method, sampling=sampling, stop=stop, k=k, chat=not args.no_chat)
    s = out.result.stats
    print(out.text)
    print(f"[{args.method}] {s.emitted} tokens in {s.elapsed_s:.2f} s: {s.tokens_per_s:.1f} tok/s, "
          f"tau {s.tau:.2f}, alpha {s.alpha:.2f}, target forwards {s.target_forwards}, "
          f"finish {out.result.finish_reason}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from specdec.bench_cli import add_bench

    add_bench(sub)


def _add_cost_curve(sub: argparse._SubParsersAction) -> None:
    from specdec.bench_cli import add_cost_curve

    add_cost_curve(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_cost_curve(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
