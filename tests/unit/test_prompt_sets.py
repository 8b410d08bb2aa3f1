"""The evaluation prompts ship inside the package: a clone anywhere (or an installed wheel) has
them, and nothing in the repository reads a folder beside it."""

import re
from pathlib import Path

import pytest

from specdec.errors import InvalidRequest
from specdec.prompt_sets import DEV_PROMPTS, first_per_category, read_prompt_rows

ROOT = Path(__file__).resolve().parents[2]
CATEGORIES = ("chat", "code", "math", "summarization", "translation", "qa", "rag")


def test_the_dev_set_ships_in_the_package_with_every_category_and_its_sources():
    rows = read_prompt_rows()
    assert {r["category"] for r in rows} == set(CATEGORIES)
    assert all(r["turns"] and r["turns"][0].strip() for r in rows)
    assert (DEV_PROMPTS.parent / "SOURCES.md").is_file()


def test_first_per_category_keeps_the_order_asked_for():
    rows = first_per_category(read_prompt_rows(), ("rag", "chat"))
    assert [r["category"] for r in rows] == ["rag", "chat"]


def test_an_unknown_category_or_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequest, match="no prompts in categories"):
        first_per_category(read_prompt_rows(), ("poetry",))
    with pytest.raises(InvalidRequest, match="prompt file not found"):
        read_prompt_rows(tmp_path / "nope.jsonl")


def test_no_code_in_the_repository_reads_a_folder_beside_it():
    pattern = re.compile(r"\.\./shared|parents\[\d\]\s*/\s*[\"']shared|[\"']shared/data")
    offenders = []
    for folder in ("specdec", "tests", "bench", "scripts", ".ci", "coordinator", "draft_service", "target_service"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and (path.suffix in (".py", ".sh", ".toml") or path.parent.name == ".ci"):
                if path.resolve() != Path(__file__).resolve() and pattern.search(path.read_text(errors="ignore")):
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
