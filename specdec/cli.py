"""`specdec` command line. User errors print one line and exit 2; never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from specdec.backends import BACKENDS
from specdec.errors import SpecdecError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from specdec.proposers import method_names

    p = sub.add_parser("generate", help="decode one prompt and print the text and a stats line")
    p.add_argument("prompt", help="the user prompt (wrapped in the chat template unless --no-chat)")
    p.add_argument("--method", default="auto", choices=("auto", *method_names()),
                   help="how tokens are proposed; auto: prompt lookup where this machine's measured verify cost "
                        "lets speculation pay, else plain (the output is the same either way)")
    p.add_argument("--k", default="auto",
                   help="tokens drafted per step: a number, or auto (default: for draft and prompt-lookup, chosen "
                        "after every step from this machine's measured verify and draft costs and the running "
                        "acceptance rate; 4 for the other methods)")
    p.add_argument("--adaptive-k", action="store_true", help="grow k on full acceptance, shrink on early rejection")
    p.add_argument("--k-max", type=int, default=16, help="upper bound for --adaptive-k")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy, exact")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches P (1 = all)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling; none = a fresh random seed")
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many generated tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft for --method draft: a model directory sharing the target's vocabulary, or a "
                   "draft made by `specdec train draft` (default: the draft shipped for the target)")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="how the target runs: hf (transformers, any model), fast (specdec's Llama forward, same "
                        "outputs, faster on CPU), fast-bf16 (LOSSY: bfloat16 weights), llamacpp (the GGUF file on "
                        "llama.cpp: its own quantized arithmetic), auto (default: for the embedded target, the "
                        "faster of llamacpp and fast on this machine, measured once; fast for Lookahead "
                        "and for other Llama-family float32 models on CPU; else hf)")
    p.add_argument("--heads", default=None, metavar="DIR",
                   help="Medusa heads directory for --method medusa (default: the heads shipped for the target)")
    p.add_argument("--eagle", default=None, metavar="DIR",
                   help="EAGLE draft directory for --method eagle, made by `specdec train eagle` (default: the one "
                        "shipped for the target)")
    p.add_argument("--eagle-depth", default="auto", choices=("auto", "k"),
                   help="--method eagle: each step's chain as deep as the draft's confidence pays for on this "
                        "machine's measured costs, at most --k (auto, default), or --k tokens (k)")
    p.add_argument("--tree", default=None,
                   help="Medusa tree: auto (default, measured), chain, a node count N, or JSON paths like [[0],[0,0],[1]]")
    p.add_argument("--typical", action="store_true",
                   help="LOSSY: Medusa typical acceptance when sampling (output no longer follows the target's distribution)")
    p.add_argument("--posterior-threshold", type=float, default=0.09, help="typical acceptance epsilon (default 0.09)")
    p.add_argument("--posterior-alpha", type=float, default=0.3, help="typical acceptance delta (default 0.3)")
    p.add_argument("--window", type=int, default=None, metavar="W", help="lookahead: Jacobi window columns (default 4)")
    p.add_argument("--ngram", type=int, default=None, metavar="N",
                   help="lookahead: n-gram size; guesses are min(N-1, --k) tokens (default 3)")
    p.add_argument("--guess", type=int, default=None, metavar="G", help="lookahead: guesses verified per step (default 2)")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec.decode import KSchedule
    from specdec.engine import Engine, EngineConfig, default_cost_store
    from specdec.types import SamplingParams, StopConditions, TypicalAcceptance

    # Validate everything cheap before loading models.
    typical = TypicalAcceptance(args.posterior_threshold, args.posterior_alpha) if args.typical else None
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              typical=typical)
    if typical is not None and sampling.greedy:
        print("specdec: note: --typical has no effect under greedy decoding (temperature 0), which stays exact",
              file=sys.stderr)
    stop = StopConditions(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))
    if args.k == "auto" and not args.adaptive_k:
        k = "auto"
    else:
        try:
            k_fixed = 4 if args.k == "auto" else int(args.k)
        except ValueError:
            raise SpecdecError(f"--k must be a positive integer or auto, got {args.k!r}") from None
        k = KSchedule(k=k_fixed, adaptive=args.adaptive_k, k_max=max(args.k_max, k_fixed))
    if not args.prompt.strip():
        raise SpecdecError("the prompt is empty")
    lookahead = _lookahead_config(args)
    _quiet_model_loading()
    config = EngineConfig(target=args.target, draft=args.draft if args.method == "draft" else None, lookahead=lookahead,
                          backend=args.backend, medusa_heads=args.heads, medusa_tree=args.tree, methods=(args.method,),
                          eagle_dir=args.eagle, eagle_depth=args.eagle_depth, prefix_cache_mb=0,
                          history_tokens=0)  # one prompt a process: nothing to reuse
    engine = Engine(config, costs=default_cost_store(config, notify=_say))
    method = engine.resolve_method(args.method)
    out = engine.complete(args.prompt, method=method, sampling=sampling, stop=stop, k=k, chat=not args.no_chat,
                          on_text=lambda piece: print(piece, end="", flush=True))
    s = out.result.stats
    print()
    label = (f"{args.method}: {method}" if method != args.method else method) + f" on {engine.backend}"
    label += ", typical acceptance: LOSSY" if typical is not None and not sampling.greedy else ""
    print(f"[{label}] {s.emitted} tokens in {s.elapsed_s:.2f} s: {s.tokens_per_s:.1f} tok/s, "
          f"tau {s.tau:.2f}, alpha {s.alpha:.2f}, target forwards {s.target_forwards}, "
          f"finish {out.result.finish_reason}")
    return 0


def _say(line: str) -> None:
    """One line on stderr about what a slow step is doing (the answer goes to stdout)."""
    print(f"specdec: {line}", file=sys.stderr, flush=True)


def _quiet_model_loading() -> None:
    """No progress bars while the models load: an ordinary run prints the answer and one stats line."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train proposers for a target")
    tsub = p.add_subparsers(dest="train_command", required=True)
    from specdec.training.commands import add_train_data, add_train_draft, add_train_eagle, add_train_medusa

    add_train_medusa(tsub)
    add_train_draft(tsub)
    add_train_eagle(tsub)
    add_train_data(tsub)


def _lookahead_config(args: argparse.Namespace):
    from specdec.proposers.lookahead import LookaheadConfig

    given = {"window": args.window, "ngram": args.ngram, "guess": args.guess}
    return LookaheadConfig(**{k: v for k, v in given.items() if v is not None})


def _add_up(sub: argparse._SubParsersAction) -> None:
    from specdec.app.cli_commands import add_up  # grpc is imported only when the command runs

    add_up(sub)


def _add_client(sub: argparse._SubParsersAction) -> None:
    from specdec.app.cli_commands import add_client

    add_client(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from specdec.bench.cli import add_bench

    add_bench(sub)


def _add_cost_curve(sub: argparse._SubParsersAction) -> None:
    from specdec.bench.cli import add_cost_curve

    add_cost_curve(sub)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text  # positionals, flags (off unless given), or a default the text already explains
        if action.default is None or action.default == []:
            shown = "none"
        elif isinstance(action.default, (list, tuple)):
            shown = ", ".join(map(str, action.default))
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with HelpFormatter; subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="specdec", description="lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_cost_curve(sub)
    _add_train(sub)
    from specdec.training.commands import add_eval

    add_eval(sub)
    _add_up(sub)
    _add_client(sub)
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
