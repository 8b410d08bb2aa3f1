"""Shared by the real-target tests: the embedded target, loaded once per session, and dev prompts."""

import json
from pathlib import Path

import pytest

from specdec.models import format_prompt, load_model

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "dev_prompts.jsonl"


def dev_prompts(tokenizer, categories=("code", "summarization", "chat"), tail: int = 200) -> list[list[int]]:
    """The first dev prompt of each category, chat-formatted, its last `tail` tokens."""
    rows = [json.loads(line) for line in SHARED_PROMPTS.read_text().splitlines()]
    picked = [next(r for r in rows if r["category"] == c) for c in categories]
    return [format_prompt(tokenizer, r["turns"][0])[-tail:] for r in picked]


@pytest.fixture(scope="session")
def real():
    return load_model()


@pytest.fixture(scope="module")
def prompts(real):
    return dev_prompts(real.tokenizer)
