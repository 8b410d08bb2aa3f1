"""CLI subcommands for drafts and training data: `specdec train draft`, `specdec train eagle`,
`specdec train data`, `specdec eval draft`. Registered by specdec/cli.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.errors import SpecdecError


def _target_name(spec) -> str:
    from specdec.models import DEFAULT_TARGET

    return DEFAULT_TARGET if spec in (None, DEFAULT_TARGET) else Path(spec).name


def add_train_medusa(tsub: argparse._SubParsersAction) -> None:
    p = tsub.add_parser("medusa", help="train Medusa heads on a frozen target from its self-distilled answers")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory: heads + config (and checkpoint.pt, hidden/ cache)")
    p.add_argument("--data", action="append", default=None,
                   help="self-distilled data: .jsonl(.gz) files, directories or globs (repeatable; "
                        "default data/selfdistill)")
    p.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head (default 1)")
    p.add_argument("--vocab", type=int, default=8192, help="draftable tokens, most frequent first (0 = all)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MIN", help="minutes of training (default 30)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--batch", type=int, default=512, help="hidden states per step (default 512)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
    p.add_argument("--checkpoint-every", type=float, default=3.0, metavar="MIN", help="minutes between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    p.add_argument("--extra-prompts", type=int, default=0, metavar="N",
                   help="also train on N generated training prompts (read only, no answers: cheap exact positions)")
    p.add_argument("--backend", default="hf", choices=["hf", "fast"],
                   help="how the target runs while its hidden states are computed (fast: same outputs, faster on CPU)")
    p.set_defaults(func=_cmd_train_medusa)


def _cmd_train_medusa(args: argparse.Namespace) -> int:
    from specdec.training.medusa import run_training_cli

    return run_training_cli(args)


def _run_arguments(p: argparse.ArgumentParser, what: str, *, data: str, work: str, minutes: str, steps: str) -> None:
    """The arguments every resumable training run takes: the target, where the result and the
    run's state go, the data, and a budget in minutes or steps."""
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, type=Path, help=f"{what} directory to write (rewritten at every checkpoint)")
    p.add_argument("--data", action="append", type=Path, default=None,
                   help=f"self-distilled data directory (repeatable; {data})")
    p.add_argument("--work", type=Path, default=None, help=work)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--time-budget", type=float, default=None, metavar="MIN", help=minutes)
    budget.add_argument("--steps", type=int, default=None, help=steps)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")


def add_train_draft(tsub: argparse._SubParsersAction) -> None:
    from specdec.training.draft import DraftRecipe

    d = DraftRecipe()
    p = tsub.add_parser("draft", help="distil a small draft (target layers + frequent-token head) from the target")
    _run_arguments(p, "draft", data="default data/selfdistill", work="checkpoint + teacher cache folder (default runs/draft)",
                   minutes="minutes of training", steps="optimiser steps")
    p.add_argument("--layers", default=",".join(map(str, d.layers)),
                   help=f"target layers copied into the draft (default {','.join(map(str, d.layers))})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"draft output vocabulary size (default {d.vocab})")
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step, help="answer tokens per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (AdamW)")
    p.add_argument("--backend", default="fast", help="target backend for the teacher (default fast)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from this draft directory's layers and token subset (retrain a draft on new data; "
                        "default: copies of the target's --layers)")
    p.set_defaults(func=_cmd_train_draft)


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from specdec.models import load_model
    from specdec.training.draft import DraftRecipe, train_draft

    try:
        layers = tuple(int(x) for x in args.layers.split(","))
    except ValueError:
        raise SpecdecError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    data = args.data or [Path("data/selfdistill")]
    missing = [str(d) for d in data if not Path(d).is_dir()]
    if missing:
        raise SpecdecError(f"training data folder not found: {', '.join(missing)} (make it with `specdec train data`)")
    if args.steps is None and args.time_budget is None:
        raise SpecdecError("give --time-budget MIN or --steps N")
    target = load_model(args.target, backend=args.backend)
    n_layers = int(getattr(target.lm.config, "num_hidden_layers", 0))
    if any(not 0 <= i < n_layers for i in layers):
        raise SpecdecError(f"--layers must be in [0, {n_layers}) for this target, got {args.layers}")
    recipe = DraftRecipe(layers=layers, vocab=args.vocab, tokens_per_step=args.tokens_per_step, lr=args.lr)
    train_draft(target.lm, data, args.out, args.work or Path("runs/draft"), recipe=recipe,
                target_name=_target_name(args.target),
                time_budget_s=None if args.time_budget is None else args.time_budget * 60,
                max_steps=args.steps, resume=args.resume, init_from=None if args.init is None else Path(args.init))
    return 0


EAGLE_DATA = (Path("data/real"), Path("data/selfdistill"), Path("data/documents"), Path("data/passages"),
              Path("data/code"))


def add_train_eagle(tsub: argparse._SubParsersAction) -> None:
    from specdec.training.eagle import EagleRecipe

    d = EagleRecipe()
    p = tsub.add_parser("eagle", help="train an EAGLE draft (one decoder layer over the target's features)")
    _run_arguments(p, "EAGLE", data=f"default: those of {', '.join(map(str, EAGLE_DATA))} that exist",
                   work="checkpoint + teacher feature cache folder (default runs/eagle)",
                   minutes="minutes, teacher pass included (it takes at most half), summed over resumed runs",
                   steps="optimizer steps (after a teacher pass over all the data)")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"draftable vocabulary size (default {d.vocab})")
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step,
                   help=f"positions per optimizer step (default {d.tokens_per_step})")
    p.add_argument("--unroll", type=int, default=d.unroll,
                   help=f"training steps per batch, all but the first on the draft's own features (default {d.unroll})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate, AdamW (default {d.lr})")
    p.add_argument("--previous-token", action="store_true",
                   help="each pair reads the token before its own too (copying from the context in one layer); "
                        "with --resume from a draft made without it, that draft is widened and trained on")
    p.add_argument("--soft-labels", action="store_true",
                   help="token loss against the target's distribution over the subset (EAGLE's), not its top-1")
    p.add_argument("--context-vocab", action="store_true",
                   help="the tokens of each request's context are draftable too, beside the frequent subset "
                        "(names and rare words an answer copies from its prompt); the token loss counts them")
    p.add_argument("--tap-layers", type=_layer_list, default=(), metavar="I,J",
                   help="each pair reads the target's residual stream after these decoder layers (0-based) too, "
                        "as EAGLE-3 fuses low and middle layers; drafting then needs the fast backend's target "
                        "(it returns them); with --init from a draft without them, that draft is widened (default: none)")
    p.add_argument("--copy-token", action="store_true",
                   help="each pair reads its copy candidate too: the token that followed the latest earlier "
                        "occurrence of the context's last n-gram (what prompt lookup drafts), so the draft learns "
                        "when an answer copies; with --init from a draft without it, that draft is widened")
    p.add_argument("--copy-labels", action="store_true",
                   help="with --copy-token: the token loss also counts a label outside the draftable subset where "
                        "it is the pair's copy candidate (which the draft drafts beside its subset)")
    p.add_argument("--token-weight", type=float, default=d.token_weight,
                   help=f"weight of the token loss (default {d.token_weight})")
    p.add_argument("--feature-weight", type=float, default=d.feature_weight,
                   help=f"weight of the feature regression (default {d.feature_weight})")
    p.add_argument("--init", type=Path, default=None, metavar="DIR",
                   help="start from this EAGLE draft's weights and vocabulary (any loss recipe; a new schedule)")
    p.add_argument("--checkpoint-every", type=float, default=5.0, metavar="MIN",
                   help="minutes between checkpoints (default 5)")
    p.add_argument("--teacher-minutes", type=float, default=None, metavar="MIN",
                   help="at most this many minutes of teacher pass in this run (default: half the time left; "
                        "all of the data with --steps alone)")
    p.add_argument("--backend", default="fast", help="target backend for the teacher (default fast)")
    p.set_defaults(func=_cmd_train_eagle)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated layer numbers (e.g. 2,15), not {text!r}") from None
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"{text}: layers are distinct numbers >= 0")
    return layers


def _cmd_train_eagle(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from specdec.models import load_model
    from specdec.training.eagle import EagleRecipe, train_eagle

    data = args.data or [d for d in EAGLE_DATA if d.is_dir()]
    missing = [str(d) for d in data if not Path(d).is_dir()]
    if missing or not data:
        raise SpecdecError(f"training data folder not found: {', '.join(missing or map(str, EAGLE_DATA))} "
                           "(make it with `specdec train data`)")
    if args.steps is None and args.time_budget is None:
        raise SpecdecError("give --time-budget MIN or --steps N")
    if args.vocab < 1 or args.tokens_per_step < 1 or args.unroll < 1:
        raise SpecdecError("--vocab, --tokens-per-step and --unroll must be >= 1")
    if args.token_weight < 0 or args.feature_weight < 0 or args.token_weight + args.feature_weight == 0:
        raise SpecdecError("--token-weight and --feature-weight must be >= 0, not both 0")
    target = load_model(args.target, backend=args.backend)
    recipe = EagleRecipe(vocab=args.vocab, tokens_per_step=args.tokens_per_step, unroll=args.unroll, lr=args.lr,
                         previous_token=args.previous_token, soft_labels=args.soft_labels,
                         context_vocab=args.context_vocab, tap_layers=args.tap_layers, copy_token=args.copy_token,
                         copy_labels=args.copy_labels,
                         token_weight=args.token_weight, feature_weight=args.feature_weight)
    train_eagle(target.lm, data, args.out, args.work or Path("runs/eagle"), recipe=recipe, init=args.init,
                target_name=_target_name(args.target),
                time_budget_s=None if args.time_budget is None else args.time_budget * 60,
                max_steps=args.steps, resume=args.resume, checkpoint_every_s=args.checkpoint_every * 60,
                teacher_time_s=None if args.teacher_minutes is None else args.teacher_minutes * 60,
                command=shlex.join(["specdec", *sys.argv[1:]]))
    print(f"use it: specdec generate --method eagle --eagle {args.out} \"PROMPT\"")
    return 0


def add_train_data(tsub: argparse._SubParsersAction) -> None:
    from specdec.training.selfdistill import add_arguments

    p = tsub.add_parser("data", help="generate self-distilled training data (the target's own answers); resumable")
    add_arguments(p)
    p.set_defaults(func=_cmd_train_data)


def _cmd_train_data(args: argparse.Namespace) -> int:
    from specdec.training.selfdistill import run

    return run(args)


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate proposers for a target")
    esub = p.add_subparsers(dest="eval_command", required=True)
    d = esub.add_parser("draft", help="alpha, tau, c and predicted vs measured speedup of a draft, per category")
    d.add_argument("--target", default=None, help="target model directory (none: the embedded default)")
    d.add_argument("--draft", default=None, help="draft directory (default: the shipped draft for the target)")
    d.add_argument("--prompts", type=Path, default=None,
                   help="JSONL with category + turns (default: held-out training prompts, seed 1)")
    d.add_argument("--per-category", type=int, default=2, help="prompts per category")
    d.add_argument("--k", type=int, default=4, help="tokens drafted per step for the fixed-k columns")
    d.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    d.add_argument("--backend", default="auto", help="target backend (default auto, as `specdec generate`)")
    d.set_defaults(func=_cmd_eval_draft)


def _cmd_eval_draft(args: argparse.Namespace) -> int:
    from specdec.drafts import load_draft, shipped_draft_path
    from specdec.models import format_prompt, load_model
    from specdec.training.draft_eval import evaluate_draft, format_report, load_prompt_file
    from specdec.training.prompts import training_prompts

    target = load_model(args.target, backend=args.backend)
    name = _target_name(args.target)
    path = Path(args.draft) if args.draft else shipped_draft_path(name)
    if path is None:
        raise SpecdecError(f"no shipped draft for {name}: pass --draft DIR")
    draft = load_draft(path, target.lm, target_name=name)
    if args.prompts is not None:
        if not args.prompts.is_file():
            raise SpecdecError(f"prompt file not found: {args.prompts}")
        prompts = load_prompt_file(args.prompts, target.tokenizer, args.per_category)
    else:
        held_out = training_prompts(seed=1, count=7 * args.per_category)
        prompts = [(p.category, format_prompt(target.tokenizer, p.text)) for p in held_out]
    reports, costs = evaluate_draft(target.lm, draft, prompts, k=args.k, max_new_tokens=args.max_new_tokens)
    history = json.loads((path / "draft_vocab.json").read_text()).get("history")
    print(format_report(reports, costs, args.k, history))
    return 0
