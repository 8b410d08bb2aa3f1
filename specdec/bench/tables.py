"""Markdown tables from the committed results of specdec/bench/serve.py (bench/results-serve/*.json), so
no figure in the README or the results' README is typed by hand.

    python -m specdec.bench.tables                 # print every table
    python -m specdec.bench.tables --write         # rewrite the generated blocks of README.md and
                                           # bench/results-serve/README.md

A generated block sits between `<!-- table: NAME -->` and `<!-- /table -->`; NAME is a results
file (without .json) and a view: `threads-2 headline`, `threads-2 per-request`, `threads-2 phases`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from specdec.bench import checkout
from specdec.bench.serve import latency_table, peer_of

ROOT = checkout()
RESULTS = ROOT / "bench" / "results-serve"
SHOWN = {"specdec": "specdec up", "specdec-nocache": "specdec up, prefix cache and history drafts off",
         "specdec-nohistory": "specdec up, history drafts off",
         "specdec-joined": "specdec up --join-sessions",
         "specdec-anycache": "specdec up --prefix-cache-any (lossy on llama.cpp)",
         "inprocess": "specdec in process (`specdec generate`)", "llama-server": "llama-server"}
BLOCK = re.compile(r"(<!-- table: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _ordered(summary: dict) -> list[str]:
    """The servers measured, in SHOWN's order (ttft columns left out)."""
    names = [k for k in summary["per_request_tok_s"]["overall"] if not k.endswith(" ttft_s")]
    return sorted(names, key=lambda n: list(SHOWN).index(n) if n in SHOWN else len(SHOWN))


def stamp_line(summary: dict) -> str:
    s, st = summary.get("settings", {}), summary.get("stamp", {})
    cache = "on" if s.get("peer_cache") == "on" else "off"
    work = ("one prompt again and again, 1-64 tokens" if "latency" in summary else
            f"two-turn conversations, {s.get('max_tokens')} tokens a turn" if "two_turn" in summary else
            f"{summary.get('prompts')} prompts, {s.get('max_tokens')} tokens, {s.get('rounds')} rounds"
            f"{', streaming' if s.get('stream') else ''}")
    backend = f", specdec's target on {s['specdec_backend']}" if s.get("specdec_backend", "auto") != "auto" else ""
    return (f"{st.get('machine', 'machine not recorded')}, {st.get('date', '?')}, commit {st.get('commit', '?')}; "
            f"{s.get('threads')} threads, {work}, llama-server's prompt cache {cache}{backend}")


def headline(summary: dict) -> str:
    """Servers as rows, categories as columns (+ 8 streams when measured)."""
    table = summary["per_request_tok_s"]
    cats = list(table)
    agg = summary.get("aggregate", {})
    streams = sorted(agg, key=int)
    head = "| tok/s per request | " + " | ".join(cats) + "".join(f" | {c} streams, aggregate" for c in streams) + " |"
    lines = [head, "|---|" + "---:|" * (len(cats) + len(streams))]
    for n in _ordered(summary):
        cells = [f"{table[c][n]:.1f}" for c in cats]
        cells += [f"{agg[c][n]['aggregate_tok_s']:.1f}" if n in agg[c] else "-" for c in streams]
        lines.append(f"| {SHOWN.get(n, n)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def per_request(summary: dict) -> str:
    """Categories as rows, servers as columns, with each server's ratio to llama-server."""
    table, names = summary["per_request_tok_s"], _ordered(summary)
    peer = peer_of(names)
    others = [n for n in names if n != peer]
    lines = ["| tok/s per request | " + " | ".join(names) + "".join(f" | {n} / {peer}" for n in others) + " |",
             "|---|" + "---:|" * (len(names) + len(others))]
    for cat, row in table.items():
        cells = [f"{row[n]:.1f}" for n in names] + [f"{row[n] / row[peer]:.2f}x" for n in others]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    equal = summary.get("texts_equal") or {}
    if isinstance(equal, dict):
        lines += ["", *(f"Texts equal to {peer}'s, {n}: {v} of {summary['prompts']}." for n, v in equal.items())]
    return "\n".join(lines) + "\n"


def phases(summary: dict) -> str:
    """Time to first token and ms per later token (streaming runs), per server."""
    ph = summary.get("phases") or {}
    names = [n for n in _ordered(summary) if any(n in per for per in ph.values())]
    lines = ["| category | " + " | ".join(f"{n} ttft s | {n} ms/token" for n in names) + " |",
             "|---|" + "---:|---:|" * len(names)]
    for cat, per in ph.items():
        cells = [f"{per[n]['ttft_s']:.3f} | {per[n]['decode_ms_per_token']:.1f}" if n in per else "- | -"
                 for n in names]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def two_turn(summary: dict) -> str:
    """Second turns of two-turn conversations: time to first token and tok/s per server."""
    lines = ["| second turn | time to first token, s | tok/s |", "|---|---:|---:|"]
    for n, v in summary["two_turn"].items():
        lines.append(f"| {SHOWN.get(n, n)} | {v['ttft_s']:.3f} | {v['tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def latency(summary: dict) -> str:
    """One prompt again and again: a request's median ms by answer length, and the ms a token."""
    return latency_table(summary["latency"], lambda n: SHOWN.get(n, n))


VIEWS = {"headline": headline, "per-request": per_request, "phases": phases, "two-turn": two_turn, "latency": latency}


def render(name: str) -> str:
    """A block's body: `FILE VIEW` -> the table and the line saying where it was measured."""
    file, view = name.split()
    summary = load(file)
    return VIEWS[view](summary) + f"\n({stamp_line(summary)}: `bench/results-serve/{file}.json`)\n"


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    args = p.parse_args(argv)
    docs = [ROOT / "README.md", RESULTS / "README.md"]
    if args.write:
        for path in docs:
            path.write_text(rewrite(path.read_text()))
        return 0
    for path in sorted(RESULTS.glob("*.json")):
        summary = json.loads(path.read_text())
        if "per_request_tok_s" in summary:
            print(f"## {path.name}\n\n{per_request(summary)}\n{stamp_line(summary)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
