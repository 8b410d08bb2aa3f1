"""Run the coordinator (the public API).

    python -m coordinator --host 0.0.0.0 --port 50051 --http-port 8000 --metrics-port 9451 --redis-url redis://HOST:6379/0
        [--draft-replicas h:p,...] [--target-replicas h:p,...] [--discovery static|kubernetes]
        [--namespace NS] [--draft-service NAME] [--target-service NAME] [--session-ttl S]
        [--grace-period S] [--config FILE]

--redis-url URL        where sessions live (required)
--http-port P          the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
                       /health, /metrics) on this port (default 8000; -1: off); same TLS and tokens as gRPC
--draft-replicas L     draft replicas host:port,... or @FILE (one per line); static discovery
--target-replicas L    target replicas host:port,... or @FILE; static discovery
--discovery MODE       static (the lists above, default) or kubernetes (watch EndpointSlices)
--namespace NS         kubernetes: namespace of the services (default: the pod's own, else "default")
--draft-service NAME   kubernetes: the draft Service whose EndpointSlices to watch (default specdec-draft)
--target-service NAME  kubernetes: the target Service (default specdec-target)
--session-ttl S        seconds a session lives in Redis after its last write (default 3600)
--costs-dir DIR        where auto keeps the draft's measured acceptance across restarts (default: the
                       user's cache folder; none: in memory)
--grace-period S       after SIGTERM: health NOT_SERVING, in-flight calls get S seconds (default 5)
--config FILE          TOML with any of these settings, keys with underscores (redis_url = "...");
                       flags given on the command line override the file
Security (README "Security"):
--tls-cert F --tls-key F   TLS on the public port (plaintext is refused off loopback unless --insecure)
--token-file F             accepted bearer token hashes (sha256 hex, one a line), re-read on change
--upstream-ca F            TLS to the draft and target: the CA that signed their certificates
--upstream-cert F --upstream-key F   the client certificate presented to them (mutual TLS)
--upstream-server-name N   the name their certificates carry (the coordinator dials pod IPs)
--redis-username U --redis-password-file F   Redis ACL user / password (or in the URL)
--redis-tls-ca F [--redis-tls-cert F --redis-tls-key F]   for a rediss:// URL with a private CA
Also: --host, --port, --metrics-port (-1: off), --pipeline, --no-step-streams, --propose-deadline-s, --max-k,
--target-wait-s, --reflection, --health-port, --max-message-bytes, --threads, --log-level.
Serves grpc.health.v1 ("" and specdec.rpc.v1.Coordinator; no token needed), reflection when
--reflection is given, and /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from specdec.rpc.security import ClientTLS, SecurityConfigError, is_loopback
from specdec.rpc.serving import (add_common_flags, apply_threads, parse_settings, run_service, serve_until_signal,
                                 server_settings)

_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p, port=50051, metrics_port=9451)
    p.set_defaults(max_message_bytes=4 << 20)
    p.add_argument("--redis-url", default=None, help="redis://HOST:6379/0 (required)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (default 8000; -1: off), same TLS and tokens as gRPC")
    p.add_argument("--draft-replicas", default="", help="host:port,... or @FILE")
    p.add_argument("--target-replicas", default="", help="host:port,... or @FILE")
    p.add_argument("--discovery", choices=["static", "kubernetes"], default="static")
    p.add_argument("--namespace", default=None)
    p.add_argument("--draft-service", default="specdec-draft")
    p.add_argument("--target-service", default="specdec-target")
    p.add_argument("--session-ttl", type=int, default=3600)
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=False,
                   help="draft the next block while the target verifies this one")
    p.add_argument("--step-streams", action=argparse.BooleanOptionalAction, default=True,
                   help="send a session's Propose and Verify calls on one long-lived stream per replica "
                        "(default on; off: a unary call per step)")
    p.add_argument("--commit-behind", action=argparse.BooleanOptionalAction, default=True,
                   help="write a step's tokens to Redis while the next step runs (default on)")
    p.add_argument("--propose-deadline-s", type=float, default=5.0)
    p.add_argument("--target-wait-s", type=float, default=30.0,
                   help="how long a session waits for a live target replica before UNAVAILABLE (default 30)")
    p.add_argument("--max-k", type=int, default=16)
    p.add_argument("--costs-dir", default=None,
                   help="where auto keeps the draft's measured acceptance across restarts (default: the user's "
                        "cache folder, as the other services' measured costs; 'none': in memory only)")
    p.add_argument("--sessions-per-target", type=int, default=8,
                   help="sessions generating at once per live target replica; the others wait their turn "
                        "(as llama-server's slots)")
    p.add_argument("--token-file", default=None,
                   help="file of accepted bearer token hashes (sha256 hex, one a line), re-read when it changes")
    p.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=False,
                   help="serve gRPC server reflection (default off)")
    up = p.add_argument_group("TLS to the draft and target services")
    up.add_argument("--upstream-ca", default=None, help="CA certificate that signed the draft's and target's")
    up.add_argument("--upstream-cert", default=None, help="client certificate presented to them (mutual TLS)")
    up.add_argument("--upstream-key", default=None, help="the private key of --upstream-cert")
    up.add_argument("--upstream-server-name", default=None,
                    help="name to check their certificates against (default: the host of each address)")
    rd = p.add_argument_group("Redis credentials and TLS")
    rd.add_argument("--redis-username", default=None, help="Redis ACL user (default: from the URL, or none)")
    rd.add_argument("--redis-password-file", default=None, help="file holding the Redis password")
    rd.add_argument("--redis-tls-ca", default=None, help="rediss://: CA certificate that signed Redis's")
    rd.add_argument("--redis-tls-cert", default=None, help="rediss://: client certificate (if Redis asks for one)")
    rd.add_argument("--redis-tls-key", default=None, help="rediss://: the private key of --redis-tls-cert")
    return p


def upstream_tls(args: argparse.Namespace) -> Optional[ClientTLS]:
    if not (args.upstream_ca or args.upstream_cert or args.upstream_key):
        return None
    return ClientTLS(ca=args.upstream_ca, cert=args.upstream_cert, key=args.upstream_key,
                     server_name=args.upstream_server_name)


def redis_options(args: argparse.Namespace) -> dict:
    opts: dict = {}
    if args.redis_username:
        opts["username"] = args.redis_username
    if args.redis_password_file:
        try:
            with open(args.redis_password_file, encoding="utf-8") as fh:
                opts["password"] = fh.read().strip()
        except OSError as exc:
            raise SecurityConfigError(f"cannot read --redis-password-file: {exc.strerror}") from None
    if args.redis_tls_ca or args.redis_tls_cert:
        if not args.redis_url.startswith("rediss://"):
            raise SecurityConfigError("--redis-tls-* need a rediss:// URL")
        opts.update(ssl_ca_certs=args.redis_tls_ca, ssl_certfile=args.redis_tls_cert,
                    ssl_keyfile=args.redis_tls_key)
    return opts


def cost_store(where: Optional[str]):
    """The coordinator's CostStore: in the folder given, the user's cache folder by default, or
    in memory ('none')."""
    from specdec.costmodel import CostStore
    from specdec.models import user_cost_store

    if where is None:
        return user_cost_store()
    return CostStore() if where.lower() == "none" else CostStore(Path(where))


async def _serve(args: argparse.Namespace) -> None:
    apply_threads(args)
    from coordinator.core import CoordinatorSettings
    from coordinator.discovery import EndpointSliceWatcher, parse_replicas
    from coordinator.servicer import start_coordinator_server

    if args.sessions_per_target < 1:
        raise SystemExit(f"--sessions-per-target must be >= 1, got {args.sessions_per_target}")
    settings = CoordinatorSettings(session_ttl_s=args.session_ttl, pipeline=args.pipeline,
                                   sessions_per_target=args.sessions_per_target,
                                   commit_behind=args.commit_behind, step_streams=args.step_streams,
                                   propose_deadline_s=args.propose_deadline_s, max_k=args.max_k,
                                   target_wait_s=args.target_wait_s)
    static = args.discovery == "static"
    drafts = parse_replicas(args.draft_replicas) if static and args.draft_replicas else []
    targets = parse_replicas(args.target_replicas) if static and args.target_replicas else []
    running = await start_coordinator_server(args.redis_url, drafts, targets, server_settings(args), settings,
                                             upstream_tls=upstream_tls(args), redis_options=redis_options(args),
                                             http_port=None if args.http_port < 0 else args.http_port,
                                             costs=cost_store(args.costs_dir))
    watchers = []
    if not static:
        ns = args.namespace or (open(_NS_FILE).read().strip() if os.path.exists(_NS_FILE) else "default")
        loop = asyncio.get_running_loop()
        core = running.core
        watchers = [EndpointSliceWatcher(ns, args.draft_service, core.draft_pool.set_addresses, loop),
                    EndpointSliceWatcher(ns, args.target_service, core.target_pool.set_addresses, loop)]
        for w in watchers:
            w.start()
    logging.getLogger("coordinator").info("coordinator listening on %s:%d (drafts %s, targets %s), metrics on %s, "
                                          "HTTP API on %s", args.host, running.port, drafts or args.discovery,
                                          targets or args.discovery, running.metrics_port,
                                          running.http.port if running.http else "none")
    await serve_until_signal(running, args.grace_period)
    for w in watchers:
        w.stop()


def _replica_hosts(args: argparse.Namespace) -> list[str]:
    from coordinator.discovery import parse_replicas

    addrs = [*(parse_replicas(args.draft_replicas) if args.draft_replicas else []),
             *(parse_replicas(args.target_replicas) if args.target_replicas else [])]
    return [a.rsplit(":", 1)[0] for a in addrs]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parse_settings(parser, argv)
    if not args.redis_url:
        parser.error("--redis-url is required (e.g. redis://127.0.0.1:6379/0)")
    if args.discovery == "static" and not args.target_replicas:
        parser.error("static discovery needs --target-replicas host:port,...")
    if upstream_tls(args) is None and not args.insecure:
        try:
            remote = [a for a in _replica_hosts(args) if not is_loopback(a)]
        except (OSError, ValueError) as exc:
            parser.error(f"bad replica list: {exc}")
        if args.discovery != "static" or remote:
            parser.error(f"plaintext to the draft/target replicas off loopback ({', '.join(remote) or args.discovery}"
                         f"): give --upstream-ca (and --upstream-cert/--upstream-key), or --insecure")
    from specdec.errors import SpecdecError

    return run_service("coordinator", _serve, args, errors=(SpecdecError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
