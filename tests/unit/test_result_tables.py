"""Every table of measured figures in README.md and bench/results-serve/README.md is the one
specdec/bench/tables.py generates from the committed results (none typed by hand, none left stale)."""

from pathlib import Path

from specdec.bench import tables

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_tables_match_the_committed_results():
    for doc in (ROOT / "README.md", ROOT / "bench" / "results-serve" / "README.md"):
        text = doc.read_text()
        assert tables.BLOCK.search(text), f"{doc.name} has no generated table"
        assert tables.rewrite(text) == text, f"{doc} is stale: run `python -m specdec.bench.tables --write`"


def test_a_table_says_where_when_and_on_which_commit_it_was_measured():
    body = tables.render("threads-2 headline")
    assert "| specdec up |" in body and "| llama-server |" in body
    stamp = tables.load("threads-2")["stamp"]
    assert stamp["commit"] in body and stamp["date"] in body and "threads" in body
