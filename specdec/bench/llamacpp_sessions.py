"""Aggregate plain-decoding throughput of the target service's core (no wire) at 1 and 8
concurrent sessions, on one backend and thread count: what the model thread gives concurrent
sessions (on llama.cpp: side by side, each on its own context, LlamaCppLM.run_each; and joined,
a context's steps in one llama_decode on shared contexts, --join-sessions), with short prompts and
with half of them ~900 tokens long.

    python -m specdec.bench.llamacpp_sessions [BACKEND] [THREADS]     # default: llamacpp 1
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from specdec.models import format_prompt, load_model
from specdec.sessions import token_digest
from specdec.types import SamplingParams
from specdec.service.sync import Position
from target_service.core import TargetCore, TargetSettings

QUESTIONS = ["Write a story about a cat.", "Explain gravity.", "List ten fruits.", "What is Python?", "Describe Paris.",
             "Write a poem about rain.", "How do planes fly?", "Name five rivers."]
NEW_TOKENS = 48


async def _session(core: TargetCore, i: int, prompt: list[int]) -> int:
    sid = f"bench-{i}-{time.monotonic_ns()}"  # (a session id: letters, digits, _ and - only)
    await core.prefill(sid, prompt)
    out = await core.decode(sid, Position(len(prompt), (), token_digest(prompt)), NEW_TOKENS, "plain", SamplingParams())
    await core.release(sid)
    return len(out.emitted)


async def _tokens_per_s(core: TargetCore, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    done = await asyncio.gather(*(_session(core, i, prompts[i % len(prompts)]) for i in range(n)))
    return sum(done) / (time.perf_counter() - t0)


async def main(backend: str, threads: int) -> None:
    torch.set_num_threads(threads)
    loaded = load_model(None, backend=backend)
    short = [format_prompt(loaded.tokenizer, q) for q in QUESTIONS]
    document = " ".join(["The river rises in the hills, runs past the old mill and the town, and reaches the sea."] * 40)
    mixed = [format_prompt(loaded.tokenizer, f"{document}\n\n{q}") if i % 2 else p
             for i, (q, p) in enumerate(zip(QUESTIONS, short))]
    joins = [False, True] if backend == "llamacpp" else [False]
    for name, prompts in (("short prompts", short), ("half of them ~900 tokens", mixed)):
        for join in joins:
            if join or backend == "llamacpp":
                loaded.lm.share_context(8 if join else 0)
            core = TargetCore(loaded.lm, TargetSettings(max_sessions=16, join_sessions=join, prefix_cache_mb=0),
                              methods={})
            await _tokens_per_s(core, prompts, 1)  # warm-up
            before, eight, after = [await _tokens_per_s(core, prompts, n) for n in (1, 8, 1)]
            one = (before + after) / 2
            print(f"{backend}, {threads} threads, {name}, sessions joined {join}: 1 session {one:.1f} tok/s, "
                  f"8 sessions {eight:.1f} tok/s aggregate: {eight / one:.2f}x", flush=True)
            await core.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "llamacpp", int(sys.argv[2]) if len(sys.argv) > 2 else 1))
