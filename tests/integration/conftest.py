"""Shared by the real-target tests: the embedded target, loaded once per session, and dev prompts."""

import pytest

from specdec.models import format_prompt, load_model
from specdec.prompt_sets import first_per_category, read_prompt_rows


def dev_prompts(tokenizer, categories=("code", "summarization", "chat"), tail: int = 200) -> list[list[int]]:
    """The first dev prompt of each category, chat-formatted, its last `tail` tokens."""
    rows = first_per_category(read_prompt_rows(), tuple(categories))
    return [format_prompt(tokenizer, r["turns"][0])[-tail:] for r in rows]


@pytest.fixture(scope="session")
def real():
    return load_model()


@pytest.fixture(scope="module")
def prompts(real):
    return dev_prompts(real.tokenizer)
