"""Run the draft service.

    python -m draft_service --host 0.0.0.0 --port 50061 --metrics-port 9461 [--draft DIR]
        [--max-sessions N] [--grace-period S] [--config FILE]

--draft DIR         draft model directory sharing the target's vocabulary, or a specdec draft
                    directory (default: the draft shipped for the embedded target, see
                    draft_service/models.py)
--max-sessions N    draft KV caches kept in memory, least recently used evicted (default 256)
--grace-period S    after SIGTERM: health NOT_SERVING, in-flight calls get S seconds (default 5)
--config FILE       TOML with any of these settings, keys with underscores (max_sessions = 256);
                    flags given on the command line override the file
--device D / --dtype T  where the model runs: auto (default: a CUDA GPU if visible, else cpu) /
                      auto (float32 on cpu, bfloat16 on a GPU)
Also: --host, --port, --metrics-port (-1: off), --max-batch, --batch-window-ms, --max-k,
--max-message-bytes, --threads, --log-level.
Serves grpc.health.v1 ("" and specdec.rpc.v1.DraftService), reflection, and /metrics.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from specdec.rpc.serving import (add_common_flags, add_model_flags, add_session_flags, apply_threads,
                                 model_placement, parse_settings, run_service, serve_until_signal, server_settings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_common_flags(p, port=50061, metrics_port=9461)
    p.add_argument("--draft", default=None, help="draft model directory (default: the draft shipped for the embedded target)")
    add_session_flags(p, max_sessions=256, batch_window_ms=1.0)
    return p


def load_draft_model(args: argparse.Namespace):
    """The draft model the flags name -> CausalLM."""
    apply_threads(args)
    from draft_service.models import load_draft

    device, dtype = model_placement(args)
    return load_draft(args.draft, device=device, dtype=dtype, backend=args.backend)


async def serve_draft(draft, args: argparse.Namespace) -> None:
    """Serve this draft model (a CausalLM) with the flags' settings until SIGTERM."""
    from draft_service.core import DraftSettings
    from draft_service.servicer import start_draft_server

    settings = DraftSettings(max_sessions=args.max_sessions, max_batch=args.max_batch,
                             batch_window_ms=args.batch_window_ms, max_k=args.max_k)
    running = await start_draft_server(draft, server_settings(args), settings)
    logging.getLogger("draft_service").info("draft service (%s) listening on %s:%d, metrics on %s", draft.name,
                                            args.host, running.port, running.metrics_port)
    await serve_until_signal(running, args.grace_period)


async def _serve(args: argparse.Namespace) -> None:
    await serve_draft(load_draft_model(args), args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_service("draft_service", _serve, parse_settings(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
