"""Run the coordinator (the public API).

    python -m coordinator --host 0.0.0.0 --port 50051 --metrics-port 9451 --redis-url redis://HOST:6379/0
        [--draft-replicas h:p,...] [--target-replicas h:p,...] [--discovery static|kubernetes]
        [--namespace NS] [--draft-service NAME] [--target-service NAME] [--session-ttl S]
        [--grace-period S] [--config FILE]

--redis-url URL        where sessions live (required)
--draft-replicas L     draft replicas host:port,... or @FILE (one per line); static discovery
--target-replicas L    target replicas host:port,... or @FILE; static discovery
--discovery MODE       static (the lists above, default) or kubernetes (watch EndpointSlices)
--namespace NS         kubernetes: namespace of the services (default: the pod's own, else "default")
--draft-service NAME   kubernetes: the draft Service whose EndpointSlices to watch (default specdec-draft)
--target-service NAME  kubernetes: the target Service (default specdec-target)
--session-ttl S        seconds a session lives in Redis after its last write (default 3600)
--grace-period S       after SIGTERM: health NOT_SERVING, in-flight calls get S seconds (default 5)
--config FILE          TOML with any of these settings, keys with underscores (redis_url = "...");
                       flags given on the command line override the file
Also: --host, --port, --metrics-port (-1: off), --pipeline, --propose-deadline-s, --max-k,
--max-message-bytes, --threads, --log-level.
Serves grpc.health.v1 ("" and specdec.rpc.v1.Coordinator), reflection, and /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional, Sequence

from specdec.rpc.serving import (add_common_flags, apply_threads, parse_settings, run_service, serve_until_signal,
                                 server_settings)

_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, port=50051, metrics_port=9451)
    p.set_defaults(max_message_bytes=4 << 20)
    p.add_argument("--redis-url", default=None, help="redis://HOST:6379/0 (required)")
    p.add_argument("--draft-replicas", default="", help="host:port,... or @FILE")
    p.add_argument("--target-replicas", default="", help="host:port,... or @FILE")
    p.add_argument("--discovery", choices=["static", "kubernetes"], default="static")
    p.add_argument("--namespace", default=None)
    p.add_argument("--draft-service", default="specdec-draft")
    p.add_argument("--target-service", default="specdec-target")
    p.add_argument("--session-ttl", type=int, default=3600)
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=False,
                   help="draft the next block while the target verifies this one")
    p.add_argument("--propose-deadline-s", type=float, default=5.0)
    p.add_argument("--max-k", type=int, default=16)
    return p


async def _serve(args: argparse.Namespace) -> None:
    apply_threads(args)
    from coordinator.core import CoordinatorSettings
    from coordinator.discovery import EndpointSliceWatcher, parse_replicas
    from coordinator.servicer import start_coordinator_server

    settings = CoordinatorSettings(session_ttl_s=args.session_ttl, pipeline=args.pipeline,
                                   propose_deadline_s=args.propose_deadline_s, max_k=args.max_k)
    static = args.discovery == "static"
    drafts = parse_replicas(args.draft_replicas) if static and args.draft_replicas else []
    targets = parse_replicas(args.target_replicas) if static and args.target_replicas else []
    running = await start_coordinator_server(args.redis_url, drafts, targets, server_settings(args), settings)
    watchers = []
    if not static:
        ns = args.namespace or (open(_NS_FILE).read().strip() if os.path.exists(_NS_FILE) else "default")
        loop = asyncio.get_running_loop()
        core = running.core
        watchers = [EndpointSliceWatcher(ns, args.draft_service, core.draft_pool.set_addresses, loop),
                    EndpointSliceWatcher(ns, args.target_service, core.target_pool.set_addresses, loop)]
        for w in watchers:
            w.start()
    logging.getLogger("coordinator").info("coordinator listening on %s:%d (drafts %s, targets %s), metrics on %s",
                                          args.host, running.port, drafts or args.discovery,
                                          targets or args.discovery, running.metrics_port)
    await serve_until_signal(running, args.grace_period)
    for w in watchers:
        w.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parse_settings(parser, argv)
    if not args.redis_url:
        parser.error("--redis-url is required (e.g. redis://127.0.0.1:6379/0)")
    if args.discovery == "static" and not args.target_replicas:
        parser.error("static discovery needs --target-replicas host:port,...")
    from specdec.errors import SpecdecError

    return run_service("coordinator", _serve, args, errors=(SpecdecError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
