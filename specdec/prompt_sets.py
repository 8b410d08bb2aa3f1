"""The evaluation prompt sets that ship with specdec (`specdec/assets/prompts/`, sources and
licences in SOURCES.md there): benchmarks, evaluations and tests read them from the installed
package, so a clone anywhere (or a wheel) has them.

`dev_prompts.jsonl`: one JSON object per line with `id`, `category` (chat, code, math,
summarization, translation, qa, rag) and `turns` (user turns; the first is used). Speed and
acceptance are measured on it: never train drafts or heads on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import InvalidRequest

PROMPTS_DIR = Path(__file__).resolve().parent / "assets" / "prompts"
DEV_PROMPTS = PROMPTS_DIR / "dev_prompts.jsonl"


def read_prompt_rows(path: Path | str = DEV_PROMPTS) -> list[dict]:
    """The rows of a JSONL prompt file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"prompt file not found: {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_per_category(rows: list[dict], categories: tuple[str, ...]) -> list[dict]:
    """The first row of each category, in the order given."""
    by_cat: dict[str, dict] = {}
    for row in rows:
        by_cat.setdefault(row["category"], row)
    missing = [c for c in categories if c not in by_cat]
    if missing:
        raise InvalidRequest(f"no prompts in categories {missing}; the file has {sorted(by_cat)}")
    return [by_cat[c] for c in categories]
