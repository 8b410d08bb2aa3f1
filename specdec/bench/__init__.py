"""Every benchmark of specdec, in one package; their committed results live in bench/ of the
repository (bench/results*/), each beside the command that produced it.

  methods            `specdec bench`: the methods side by side with HF generate, assisted
                     generation and prompt lookup, in process (table, plot, JSON)
  cli                `specdec bench` and `specdec cost-curve`: argument parsing
  serve              `python -m specdec.bench.serve`: `specdec up` against llama-server (or any
                     OpenAI-compatible server), same prompts, client and concurrency
  services           `python -m specdec.bench.services`: the services against in process,
                     concurrency, pipelining, gRPC vs HTTP streaming, the per-step profile
  load               `python -m specdec.bench.load`: sustained load through the OpenAI API
  llamacpp_builds    `python -m specdec.bench.llamacpp_builds`: llama.cpp builds side by side
  llamacpp_sessions  `python -m specdec.bench.llamacpp_sessions`: concurrent sessions on one target
  lookahead_tune     `python -m specdec.bench.lookahead_tune`: Lookahead's (W, N, G) on this machine
  tables             `python -m specdec.bench.tables --write`: the docs' tables from the results
  slow_service       a service whose model sleeps per call (a stand-in for a busy GPU or a network hop)

Benchmarks print figures measured side by side in one run; none is a timed test.
"""

from __future__ import annotations

from pathlib import Path


def checkout() -> Path:
    """The repository the benchmarks run from (its scripts/ and bench/ results): the checkout
    this package sits in, else the current folder."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "scripts").is_dir() and (root / "bench").is_dir() else Path.cwd()
