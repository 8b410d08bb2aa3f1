"""Self-distilled training data: the target's own answers to the training prompts.

Drafts and Medusa heads are trained to predict what the *target* says, so the target writes
the data. Output: gzip JSONL parts, one per chunk of prompts ({"index", "category", "sampled",
"prompt_ids", "answer_ids"} per line). Parts are written atomically and skipped when present,
so an interrupted run resumes where it stopped and the data can keep growing over sessions.
Two chunks in three are greedy (what greedy acceptance is measured on), one is sampled at
temperature 0.7 for variety.

Prompt sets (`--set`): `real` (real instructions from a JSONL file, by default the shipped
`data/prompts/train_prompts.jsonl.gz`: GSM8K train, GPTeacher roleplay and toolformer, sources
and licences beside it; shuffled by the seed so any first `--count` mixes all sources), `base`
(specdec.training.prompts: short prompts from templates and the stdlib), `articles` (the target writes news stories and encyclopedia entries) and `documents`
(summarize / answer from those articles, translate gettext messages into English, factual
questions: specdec.training.documents), which needs the articles first, and `passages`
(summarize / answer from passages of the machine's manual pages, translate sentences of their
German translations: text people wrote, specdec.training.documents.passage_prompts), and `code`
(complete, explain, rewrite, document or test the standard library's own functions, write a
function from a task: specdec.training.prompts.code_prompts):

    specdec train data --set real --out data/real --count 3000 --time-budget 60
    specdec train data --out data/selfdistill --count 2000 --time-budget 60
    specdec train data --set articles --out data/articles --count 240
    specdec train data --set documents --articles data/articles --out data/documents --count 960
    specdec train data --set passages --out data/passages --count 1200 --max-new-tokens 160
    specdec train data --set code --out data/code --count 640 --time-budget 60
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import time
from pathlib import Path
from typing import Iterator, Optional

from specdec.decode import plain_generate
from specdec.errors import SpecdecError
from specdec.models import LoadedModel, format_prompt, load_model
from specdec.training.documents import (all_foreign_sentences, article_prompts, article_specs, document_prompts,
                                        man_passages, passage_prompts, sentences)
from specdec.training.prompts import TrainingPrompt, code_prompts, training_prompts
from specdec.types import SamplingParams, StopConditions

REAL_PROMPTS = Path("data/prompts/train_prompts.jsonl.gz")
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


def written_articles(articles_dir: Path, tokenizer, seed: int) -> list[tuple[str, str]]:
    """(article text, its question) for every article generated so far in `articles_dir`."""
    rows = sorted(read_parts(articles_dir), key=lambda r: r["index"])
    if not rows:
        return []
    specs = article_specs(seed, rows[-1]["index"] + 1)
    return [(drop_repeated_paragraphs(tokenizer.decode(r["answer_ids"], skip_special_tokens=True)),
             specs[r["index"]][1]) for r in rows if r["answer_ids"]]


def drop_repeated_paragraphs(text: str) -> str:
    """A small target's text can loop; keep the first occurrence of each paragraph."""
    paragraphs = [p.strip() for p in text.strip().split("\n\n")]
    return "\n\n".join(dict.fromkeys(p for p in paragraphs if p))


def real_prompts(path: Path, seed: int, count: int, start: int = 0) -> list[TrainingPrompt]:
    """`count` of a JSONL(.gz) file's {"category", "prompt"} rows after a seeded shuffle, from
    the `start`-th (`--set real --count N` takes the first N)."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                rows.append(TrainingPrompt(category=str(row["category"]), text=str(row["prompt"])))
            except (ValueError, KeyError, TypeError):
                raise SpecdecError(f"{path}:{n}: not a JSON object with 'category' and 'prompt'") from None
    random.Random(seed).shuffle(rows)
    return rows[start : start + count]


def training_kind_prompts(per_category: int, real_dir: Path = Path("data/real"), prompts_file: Path = REAL_PROMPTS,
                          seed: int = 0, template_seed: int = 1) -> list[TrainingPrompt]:
    """Prompts of the kinds the drafts are trained on, per category `per_category` of each:
    real instructions that `real_dir` (made by `--set real --seed seed`) holds no answer to, the
    ones after those it took ("real-<category>"), and prompts drawn again from the `base`
    templates with another seed ("template-<category>"; the templates are few, so some may
    equal a training prompt). What a draft scores on these beside the dev prompts tells how
    much of the gap is the dev prompts' kinds (specdec.training.eagle_eval --training-kinds)."""
    used = max((row["index"] + 1 for row in read_parts(real_dir)), default=0)
    picked: list[TrainingPrompt] = []
    counts: dict[str, int] = {}
    for kind, prompts in (("real", real_prompts(prompts_file, seed, 1 << 30, start=used)),
                          ("template", training_prompts(template_seed, 64 * per_category))):
        for p in prompts:
            cat = f"{kind}-{p.category}"
            if counts.get(cat, 0) < per_category:
                counts[cat] = counts.get(cat, 0) + 1
                picked.append(TrainingPrompt(cat, p.text))
    return picked


def prompt_set(name: str, target: LoadedModel, *, seed: int, count: int,
               articles_dir: Optional[Path] = None, prompts_file: Path = REAL_PROMPTS,
               man_dir: Path = Path("/usr/share/man")) -> list[TrainingPrompt]:
    if name == "real":
        return real_prompts(prompts_file, seed, count)
    if name == "base":
        return training_prompts(seed, count)
    if name == "code":
        return code_prompts(seed, count)
    if name == "articles":
        return article_prompts(seed, count)
    if name == "documents":
        if articles_dir is None or not any(Path(articles_dir).glob("part-*.jsonl.gz")):
            raise SpecdecError(f"--set documents needs generated articles (--articles DIR): none in {articles_dir}; "
                               "make them with `specdec train data --set articles --out DIR` first")
        return document_prompts(seed, written_articles(articles_dir, target.tokenizer, seed), count,
                                all_foreign_sentences())
    if name == "passages":
        passages = man_passages(man_dir)
        if not passages:
            raise SpecdecError(f"--set passages reads the manual pages under {man_dir}: none with prose found there")
        return passage_prompts(seed, passages, count, {"de": sentences(man_passages(man_dir / "de", min_words=6))})
    raise SpecdecError(f"unknown prompt set {name!r}; use one of {', '.join(PROMPT_SETS)}")


PROMPT_SETS = ("real", "base", "code", "articles", "documents", "passages")


def generate(out_dir: Path, target: LoadedModel, prompts: list[TrainingPrompt], *, seed: int = 0, chunk: int = 16,
             max_new_tokens: int = 192, time_budget_s: Optional[float] = None, sample_every: int = 3) -> int:
    """Generate the missing parts; returns the number of parts written by this call. Every
    `sample_every`-th chunk is sampled at temperature 0.7, the others greedy (1: all sampled)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    count = len(prompts)
    t0, written = time.monotonic(), 0
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=target.lm.eos_token_ids)
    starts = [s for s in range(0, count, chunk) if not part_path(out_dir, s).exists()]
    for n, start in enumerate(starts):
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            break
        batch = prompts[start : start + chunk]
        ids = [format_prompt(target.tokenizer, p.text)[-MAX_PROMPT_TOKENS:] for p in batch]
        sampled = (start // chunk) % sample_every == sample_every - 1
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("data/selfdistill"), help="output folder (parts are resumable)")
    ap.add_argument("--set", dest="prompt_set", choices=PROMPT_SETS, default="base",
                    help="prompt set (default base; documents needs --articles; passages reads /usr/share/man)")
    ap.add_argument("--articles", type=Path, default=None, help="articles folder for --set documents")
    ap.add_argument("--prompts", type=Path, default=REAL_PROMPTS,
                    help=f"JSONL(.gz) of {{category, prompt}} rows for --set real (default {REAL_PROMPTS})")
    ap.add_argument("--target", default=None, help="target model directory (none: the embedded default)")
    ap.add_argument("--seed", type=int, default=0, help="prompt set and sampling seed")
    ap.add_argument("--count", type=int, default=2000, help="prompts in the set")
    ap.add_argument("--chunk", type=int, default=16, help="prompts generated together (one part file)")
    ap.add_argument("--max-new-tokens", type=int, default=192, help="longest answer")
    ap.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                    help="stop starting new parts after MIN minutes (none: run to --count)")
    ap.add_argument("--backend", default="fast", help="model backend (see specdec.models.BACKENDS)")


def run(args: argparse.Namespace) -> int:
    target = load_model(args.target, backend=args.backend)
    prompts = prompt_set(args.prompt_set, target, seed=args.seed, count=args.count, articles_dir=args.articles,
                         prompts_file=args.prompts)
    # Articles are all sampled: greedy decoding of a small target loops on its first paragraphs.
    generate(args.out, target, prompts, seed=args.seed, chunk=args.chunk, max_new_tokens=args.max_new_tokens,
             time_budget_s=None if args.time_budget is None else args.time_budget * 60,
             sample_every=1 if args.prompt_set == "articles" else 3)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
