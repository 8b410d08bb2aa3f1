"""`specdec up` (redis-server + the three services on loopback) and `specdec client` (talk to a
coordinator). Registered by specdec/cli.py; grpc is imported only when a command runs."""

from __future__ import annotations

import argparse
import os
import sys


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start redis-server, the target, draft and coordinator services on loopback")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument("--port", type=int, default=50051, help="coordinator port (what `specdec client` calls)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="coordinator's OpenAI-compatible HTTP API port (base URL http://HOST:PORT/v1; -1: off)")
    p.add_argument("--draft-port", type=int, default=50061, help="draft service port")
    p.add_argument("--target-port", type=int, default=50062, help="target service port")
    p.add_argument("--redis-port", type=int, default=0, help="redis-server port (0: a free port)")
    p.add_argument("--target", default=None, help="target model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft model directory (default: the draft shipped for the embedded target)")
    p.add_argument("--target-backend", default="auto", choices=["auto", "hf", "fast", "llamacpp"],
                   help="how the target service runs its model (its --backend; llamacpp: the GGUF on llama.cpp, "
                        "no Lookahead, Medusa as a chain)")
    p.add_argument("--draft-backend", default="auto", choices=["auto", "hf", "fast", "llamacpp"],
                   help="how the draft service runs its draft (auto: torch or llama.cpp, whichever measured the "
                        "cheaper step here)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads of the target and of the draft service each (0: each model's default, a thread per core)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="the target's prefix cache: MiB of KV of earlier prompts and turns (0: off)")
    p.add_argument("--prefix-cache-any", action="store_true",
                   help="the target's --prefix-cache-any: any cached prefix, even on a backend whose kernels depend "
                        "on a forward's width (LOSSY there; torch and specdec's llama.cpp reuse any prefix exactly)")
    p.add_argument("--history-tokens", type=int, default=1 << 17,
                   help="the target's drafts from earlier sessions: tokens of their prompts and answers kept, whose "
                        "continuation plain decoding drafts where a session's end matches (0: off)")
    p.add_argument("--join-sessions", action="store_true",
                   help="llama.cpp target: concurrent sessions' plain steps in one llama_decode (the target's "
                        "--join-sessions)")
    p.add_argument("--pipeline", action="store_true", help="draft the next block while the target verifies")
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints (9451, 9461, 9462)")
    p.add_argument("--log-dir", default=None, help="write each service's log here (default: this terminal)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the services to serve")
    p.set_defaults(func=_cmd_up)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _cmd_up(args: argparse.Namespace) -> int:
    import signal

    from specdec.errors import SpecdecError
    from specdec.app.launcher import start_stack

    if args.log_dir:  # made (or refused) before anything starts
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as exc:
            raise SpecdecError(f"--log-dir {args.log_dir}: cannot create it ({exc.strerror})") from None
    # Ctrl-C, and SIGTERM (also when started in the background, where SIGINT may be ignored) stop everything.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    threads = ["--threads", str(args.threads)] if args.threads > 0 else []
    print("specdec up: starting redis-server, target, draft and coordinator (loading models takes a while)...",
          file=sys.stderr)
    stack = start_stack(args.host, (args.port, args.draft_port, args.target_port), args.redis_port, args.draft,
                        args.target, args.pipeline, metrics=not args.no_metrics, timeout=args.timeout,
                        log_dir=args.log_dir, http_port=None if args.http_port < 0 else args.http_port,
                        extra={"target": ["--backend", args.target_backend, *threads,
                                          "--prefix-cache-mb", str(args.prefix_cache_mb),
                                          "--history-tokens", str(args.history_tokens),
                                          *(["--prefix-cache-any"] if args.prefix_cache_any else []),
                                          *(["--join-sessions"] if args.join_sessions else [])],
                               "draft": ["--backend", args.draft_backend, *threads]})
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        print(f"redis        {stack.redis.url}  (pid {stack.redis.proc.pid})")
        for svc in stack.services:
            print(f"{svc.name:<12} {args.host}:{svc.port}  (pid {svc.proc.pid})")
        if stack.http_url:
            print(f"{'openai api':<12} {stack.http_url}  (OpenAI-compatible HTTP: set the SDK's base_url to it)")
        print(f'specdec up: ready. Try: specdec client "Write a haiku about the sea." --address {args.host}:{args.port}'
              f"   (Ctrl-C stops everything)", flush=True)
        # A child that dies is restarted (with back-off); everything stops only on Ctrl-C / SIGTERM.
        stack.supervise(say)
    except KeyboardInterrupt:
        say("\nspecdec up: stopping...")
    finally:
        stack.stop()
    say("specdec up: stopped")
    return 0


def add_client(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="send a prompt to a running coordinator (see `specdec up`)")
    p.add_argument("prompt", nargs="?", default=None, help="the user prompt (chat template unless --no-chat)")
    p.add_argument("--address", default="127.0.0.1:50051", help="coordinator host:port")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    p.add_argument("--method", default="auto",
                   help="auto (draft, falling back to the target), draft, plain, target, or a target-side method")
    p.add_argument("--k", type=int, default=0, help="tokens drafted per step (0: the coordinator's default, 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else sample, in [1e-4, 100]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: fresh randomness)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--session-id", default="", help="name the session (to resume it later), or resume one")
    p.add_argument("--resume-from", type=int, default=0, help="resume: generated tokens you already have")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the call in seconds")
    p.add_argument("--connect-timeout", type=float, default=20.0,
                   help="seconds to wait for the coordinator to accept a connection")
    p.add_argument("--token-file", default=None,
                   help="file whose first line is your bearer token (default: the SPECDEC_TOKEN environment variable)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (trusting the system's CAs unless --tls-ca)")
    p.add_argument("--tls-ca", default=None, help="CA certificate that signed the coordinator's (implies --tls)")
    p.add_argument("--tls-server-name", default=None, help="name the coordinator's certificate carries "
                   "(default: the host of --address)")
    p.set_defaults(func=_cmd_client)


def _resume_hint(address: str, session_id: str, committed: int) -> str:
    return (f"specdec client: cut after {committed} tokens; resume with: specdec client --session-id {session_id} "
            f"--resume-from {committed} --address {address} --stream")


def _cmd_client(args: argparse.Namespace) -> int:
    # gRPC's C core logs connection events on stderr at INFO (e.g. "Got goaway ... Cancelling all
    # calls" when a server goes away mid-stream); the client prints its own one-line messages
    # instead. Read when grpc loads, so set before the imports below (a user's setting wins).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    import asyncio

    from specdec.errors import SpecdecError
    from specdec.rpc.clients import CoordinatorClient
    from specdec.types import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.prompt is None and not args.session_id:
        raise SpecdecError("give a prompt (or --session-id to resume a session)")
    if args.prompt is not None and not args.prompt.strip():
        raise SpecdecError("the prompt is empty")
    if args.prompt is None:
        prompt = {}
    elif args.no_chat:
        prompt = {"text": args.prompt}
    else:
        prompt = {"chat": [("user", args.prompt)]}
    req = CoordinatorClient.request(**prompt, max_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                                    method=args.method, k=args.k, session_id=args.session_id,
                                    resume_from=args.resume_from)

    from specdec.rpc.security import ClientTLS, read_token

    tls = (ClientTLS(ca=args.tls_ca, server_name=args.tls_server_name) if args.tls or args.tls_ca
           else None)
    token = read_token(args.token_file)

    async def go() -> dict:
        client = CoordinatorClient(args.address, timeout=args.timeout, tls=tls, token=token)
        try:
            if not await client.wait_ready(args.connect_timeout):
                raise SpecdecError(f"no coordinator answers at {args.address}: start one with `specdec up` "
                                   f"(or give --address HOST:PORT)")
            if args.stream:
                stats, session_id, committed = {}, args.session_id, args.resume_from
                try:
                    async for chunk in client.generate_stream(req):
                        print(chunk.text, end="", flush=True)
                        session_id, committed = chunk.session_id, chunk.offset + len(chunk.token_ids)
                        if chunk.finish_reason:
                            stats = dict(chunk.stats or {}, finish_reason=chunk.finish_reason,
                                         session_id=chunk.session_id, committed=committed)
                except (SpecdecError, asyncio.CancelledError):
                    # Cut (coordinator gone, deadline, Ctrl-C): say how to get the rest.
                    print(flush=True)
                    if session_id:
                        print(_resume_hint(args.address, session_id, committed), file=sys.stderr, flush=True)
                    raise
                print()
                return stats
            out = await client.generate(req)
            print(out.text)
            return dict(out.stats, finish_reason=out.finish_reason, session_id=out.session_id,
                        committed=args.resume_from + len(out.token_ids))
        finally:
            await client.close()

    s = asyncio.run(go())
    if s:
        print(f"[{args.method}] {s['emitted']} tokens in {s['elapsed_s']:.2f} s: {s['tokens_per_s']:.1f} tok/s, "
              f"tau {s['tau']:.2f}, alpha {s['alpha']:.2f}, target forwards {s['target_forwards']}, "
              f"fallback steps {s['fallback_steps']}, finish {s['finish_reason']}, session {s['session_id']}, "
              f"{s['committed']} tokens committed",
              file=sys.stderr)
    return 0
