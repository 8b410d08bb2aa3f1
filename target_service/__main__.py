"""Run the target (verifier) service.

    python -m target_service --host 0.0.0.0 --port 50062 --metrics-port 9462 [--target DIR]
        [--max-sessions N] [--max-batch N] [--batch-window-ms MS] [--grace-period S] [--config FILE]

--target DIR          target model directory (default: the embedded SmolLM2-135M-Instruct)
--max-sessions N      KV caches kept in memory, least recently used evicted (default 64)
--prefix-cache-mb MB  KV of prompts and finished sessions kept for sessions that start the same way
                      (default 1024; 0: off); on llama.cpp only whole 512-token prefill blocks of prompts,
                      what a fresh prefill computes the same way
--prefix-cache-any    LOSSY on llama.cpp: reuse any cached prefix, decoded answers too, as llama-server's
                      prompt cache (a next turn starts sooner; it may part from a fresh prefill's at near-ties)
--history-tokens N    tokens of finished sessions (prompt and answer) that plain decoding drafts from
                      where a session's end matches one of them (default 131072; 0: off)
--max-batch N         sessions verified in one forward pass (default 8)
--join-sessions       on llama.cpp, concurrent sessions on shared contexts (one a thread), a context's
                      plain steps in one llama_decode (outputs then depend on other sessions' rounding
                      at near-ties; default off: each session on a context of its own)
--batch-window-ms MS  how long a Verify waits for others to batch with (default 2)
--grace-period S      after SIGTERM: health NOT_SERVING, in-flight calls get S seconds (default 5)
--config FILE         TOML with any of these settings, keys with underscores (max_batch = 8);
                      flags given on the command line override the file
--device D / --dtype T  where the model runs: auto (default: a CUDA GPU if visible, else cpu) /
                      auto (float32 on cpu, bfloat16 on a GPU)
Also: --host, --port, --metrics-port (-1: off), --max-k, --max-message-bytes, --threads, --log-level.
Serves grpc.health.v1 ("" and specdec.rpc.v1.TargetService), reflection, and /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import sys
from typing import Optional, Sequence

from specdec.errors import SpecdecError
from specdec.rpc.serving import (add_common_flags, add_model_flags, add_session_flags, apply_threads,
                                 model_placement, parse_settings, run_service, serve_until_signal, server_settings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m target_service", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_common_flags(p, port=50062, metrics_port=9462)
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="MiB of KV kept for prompts and finished sessions, reused by sessions that start the same "
                        "way (0: off)")
    p.add_argument("--prefix-cache-any", action="store_true",
                   help="reuse any cached prefix even on a backend whose kernels depend on a forward's width (LOSSY "
                        "there: answers may part from a fresh prefill's at near-ties); torch and specdec's llama.cpp "
                        "build reuse any prefix exactly, with or without it (specdec.prefix_cache)")
    p.add_argument("--history-tokens", type=int, default=1 << 17,
                   help="tokens of finished sessions (prompt and answer) kept for drafts: plain decoding drafts what "
                        "followed where a session's end matches one of them (0: off)")
    p.add_argument("--join-sessions", action="store_true",
                   help="llama.cpp: concurrent sessions on shared contexts (one a thread), each context's plain "
                        "steps in one llama_decode (no gain through the services measured yet: off by default)")
    add_session_flags(p, max_sessions=64, batch_window_ms=2.0)
    return p


def load_target(args: argparse.Namespace):
    """The target model the flags name -> specdec.models.LoadedModel. `--backend auto` on the CPU
    means what it means for `specdec generate`: for a target that both llama.cpp and torch run (the
    embedded default), whichever serves a typical request faster here, measured once and kept
    (specdec.backends.choice); llama.cpp only after its probe passed on this machine and build."""
    apply_threads(args)
    from specdec.engine import EngineConfig, default_cost_store
    from specdec.models import load_model

    device, dtype = model_placement(args)
    config = EngineConfig(target=args.target, backend=args.backend)
    costs = default_cost_store(config, notify=logging.getLogger("target_service").info)
    if args.backend == "auto" and device == "cpu":
        from specdec.backends.choice import load_fastest

        return load_fastest(args.target, ("auto",), costs)
    return load_model(args.target, device=device, dtype=dtype, backend=args.backend, costs=costs)


def tokenizer_dir_of(loaded, keep: list) -> Optional[str]:
    """A directory holding the target's tokenizer files, which the service ships to the
    coordinator (Info): the model directory itself, or, for a GGUF file, its tokenizer written
    out by transformers into a temporary directory (appended to `keep`, which holds it open)."""
    import os
    import tempfile

    if loaded.path and os.path.isdir(loaded.path):
        return loaded.path
    if loaded.tokenizer is None:
        return None
    tmp = tempfile.TemporaryDirectory(prefix="specdec-target-tokenizer-")
    loaded.tokenizer.save_pretrained(tmp.name)
    keep.append(tmp)
    return tmp.name


async def serve_target(lm, tokenizer_dir: Optional[str], args: argparse.Namespace, executor=None) -> None:
    """Serve this target model (a CausalLM) with the flags' settings until SIGTERM. executor: the
    thread the model was loaded on, which runs all its work (see _serve)."""
    from target_service.core import TargetSettings, warm_up
    from target_service.servicer import start_target_server

    settings = TargetSettings(max_sessions=args.max_sessions, max_batch=args.max_batch,
                              prefix_cache_mb=args.prefix_cache_mb, prefix_cache_any=args.prefix_cache_any,
                              join_sessions=args.join_sessions,
                              history_tokens=args.history_tokens,
                              batch_window_ms=args.batch_window_ms, max_k=args.max_k)
    await asyncio.get_running_loop().run_in_executor(executor, warm_up, lm)  # before it serves
    running = await start_target_server(lm, server_settings(args), settings, tokenizer_dir=tokenizer_dir,
                                        executor=executor)
    await running.core.batcher.run_alone(running.core.local_method)  # Decode "auto"'s method, measured once
    logging.getLogger("target_service").info(
        "target service (%s, methods: %s) listening on %s:%d, metrics on %s", lm.name,
        ", ".join(running.core.available_methods()), args.host, running.port, running.metrics_port)
    await serve_until_signal(running, args.grace_period)


async def _serve(args: argparse.Namespace) -> None:
    if args.prefix_cache_mb < 0:  # (before a model loads)
        raise SpecdecError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.history_tokens < 0:
        raise SpecdecError(f"--history-tokens must be >= 0, got {args.history_tokens}")
    # One thread loads the model and runs all its work (the batcher's): llama.cpp's OpenMP team
    # belongs to the thread that starts it, and in a process where a second thread also ran one
    # (torch while loading, on the event loop), llama.cpp decoded at 0.45x its speed, measured.
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
    loaded = await asyncio.get_running_loop().run_in_executor(executor, load_target, args)
    keep: list = []
    try:
        await serve_target(loaded.lm, tokenizer_dir_of(loaded, keep), args, executor)
    finally:
        for tmp in keep:
            tmp.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_service("target_service", _serve, parse_settings(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
