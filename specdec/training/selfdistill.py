"""Self-distilled training data: the target's own answers to the training prompts.

Drafts and Medusa heads are trained to predict what the *target* says, so the target writes
the data. Output: gzip JSONL parts, one per chunk of prompts ({"index", "category", "sampled",
"prompt_ids", "answer_ids"} per line). Parts are written atomically and skipped when present,
so an interrupted run resumes where it stopped and the data can keep growing over sessions.
Two chunks in three are greedy (what greedy acceptance is measured on), one is sampled at
temperature 0.7 for variety.

    python -m specdec.training.selfdistill --out data/selfdistill --count 2000 --time-budget 60
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path
from typing import Iterator, Optional

from specdec.decode import plain_generate
from specdec.models import LoadedModel, format_prompt, load_model
from specdec.training.prompts import training_prompts
from specdec.types import SamplingParams, StopConditions

MAX_PROMPT_TOKENS = 384  # longer prompts are cut from the left; prefill of long prompts dominated generation cost


def part_path(out_dir: Path, start: int) -> Path:
    return out_dir / f"part-{start:05d}.jsonl.gz"


def write_part(out_dir: Path, start: int, rows: list[dict]) -> None:
    """Write one part atomically: a crash never leaves a truncated part behind."""
    tmp = part_path(out_dir, start).with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, part_path(out_dir, start))


def read_parts(out_dir: Path) -> Iterator[dict]:
    for path in sorted(Path(out_dir).glob("part-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                yield json.loads(line)


def generate(out_dir: Path, target: LoadedModel, *, seed: int = 0, count: int = 2000, chunk: int = 16,
             max_new_tokens: int = 192, time_budget_s: Optional[float] = None) -> int:
    """Generate the missing parts; returns the number of parts written by this call."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(seed, count)
    t0, written = time.monotonic(), 0
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.lm.eos_token_ids)
    starts = [s for s in range(0, count, chunk) if not part_path(out_dir, s).exists()]
    for n, start in enumerate(starts):
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            break
        batch = prompts[start : start + chunk]
        ids = [format_prompt(target.tokenizer, p.text)[-MAX_PROMPT_TOKENS:] for p in batch]
        sampled = (start // chunk) % 3 == 2
        sampling = SamplingParams(temperature=0.7, seed=seed * 100_003 + start) if sampled else SamplingParams()
        tb = time.monotonic()
        results = plain_generate(target.lm, ids, sampling=sampling, stop=stop)
        tokens = sum(len(r.token_ids) for r in results)
        write_part(out_dir, start, [{"index": start + i, "category": p.category, "sampled": sampled,
                                     "prompt_ids": pid, "answer_ids": list(r.token_ids)}
                                    for i, (p, pid, r) in enumerate(zip(batch, ids, results))])
        written += 1
        print(f"part {start:05d} ({n + 1}/{len(starts)}): {tokens} tokens, "
              f"{tokens / (time.monotonic() - tb):.1f} tok/s, {time.monotonic() - t0:.0f} s elapsed", flush=True)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--time-budget", type=float, default=None, help="minutes")
    ap.add_argument("--backend", default="fast", help="model backend (see specdec.models.BACKENDS)")
    args = ap.parse_args(argv)
    target = load_model(args.target, backend=args.backend)
    generate(args.out, target, seed=args.seed, count=args.count, chunk=args.chunk,
             max_new_tokens=args.max_new_tokens,
             time_budget_s=None if args.time_budget is None else args.time_budget * 60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
