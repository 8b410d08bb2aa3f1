"""Sustained load through the coordinator on loopback (issue 16, test 8): a benchmark, not a test.

    python -m specdec.bench.load [--streams 64] [--seconds 60] [--max-tokens 64] [--k 4] [--real [--threads 2]]

Starts redis-server, a draft, a target and a coordinator, each its own process on 127.0.0.1 with
tiny seeded models (`--serve ...`), or with --real `specdec up` as a user runs it (the
embedded default, its defaults; prompts: the held-out dev set's first turns, as text), then keeps
N streams busy for S seconds: each stream opens GenerateStream with a prompt, reads it to the end
(tiny models: all max-tokens; real: to the end of the answer), and starts the next. Prints
the errors (by status), p50/p99 time to first token and inter-token latency (between streamed
chunks, per token), tokens/s, and each process's RSS at baseline (after a warm-up request),
right after the load, and after a settle pause: whether it is back within 10% of its baseline.
Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from specdec.bench import checkout
from specdec.prompt_sets import read_prompt_rows

VOCAB = 96


def children(pid: int) -> list[int]:
    """Every process below pid (Linux /proc), depth first."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            kids = [int(x) for x in fh.read().split()]
    except OSError:
        return []
    return [p for k in kids for p in (k, *children(k))]


def process_name(pid: int) -> str:
    """A short name from a process's command line: the service it runs."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().decode(errors="replace").split("\0")
    for known in ("redis-server", "coordinator", "draft_service", "target_service"):
        if any(known in a for a in argv):
            return known
    return os.path.basename(argv[0])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def serve(role: str, port: int, redis_url: str, draft: str, target: str) -> None:
    """One service in this process, tiny seeded models (the same as tests/services/conftest.py)."""
    import torch

    torch.set_num_threads(1)
    from specdec.testing import perturbed_copy, tiny_llama
    from specdec.rpc.serving import ServerSettings

    lm = tiny_llama(seed=0, vocab_size=VOCAB, num_layers=2, hidden_size=48, eos_token_id=None, max_positions=512)
    settings = ServerSettings(port=port)
    if role == "draft":
        from draft_service.servicer import start_draft_server
        srv = await start_draft_server(perturbed_copy(lm, noise=0.05, seed=3), settings)
    elif role == "target":
        from target_service.servicer import start_target_server
        srv = await start_target_server(lm, settings)
    else:
        from coordinator.servicer import PUBLIC_MAX_MESSAGE_BYTES, start_coordinator_server
        settings = ServerSettings(port=port, max_message_bytes=PUBLIC_MAX_MESSAGE_BYTES)
        srv = await start_coordinator_server(redis_url, [draft], [target], server=settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await srv.stop(1)


async def wait_serving(address: str, timeout: float = 60) -> None:
    from specdec.rpc.clients import ServiceClient

    probe = ServiceClient(address)
    try:
        for _ in range(int(timeout / 0.2)):
            if await probe.healthy():
                return
            await asyncio.sleep(0.2)
        raise SystemExit(f"{address} did not become SERVING within {timeout} s")
    finally:
        await probe.close()


async def load(args, address: str, pids: dict[str, int], kept=lambda name: 0.0) -> None:
    """kept(name): MiB a process keeps by design after the load (the target's prefix cache, up to
    its budget), allowed above its baseline."""
    from specdec.errors import SpecdecError
    from specdec.rpc.clients import CoordinatorClient

    client = CoordinatorClient(address)
    texts = [r["turns"][0] for r in read_prompt_rows()] if args.real else []

    def request(i: int, n: int):
        if args.real:
            return client.request(text=texts[(i * 5 + n) % len(texts)], max_tokens=args.max_tokens)
        prompt = [(i * 7 + n * 3 + j) % (VOCAB - 2) + 2 for j in range(8)]
        return client.request(token_ids=prompt, max_tokens=args.max_tokens, k=args.k)

    warm = await client.generate(request(0, 0))
    assert args.real or len(warm.token_ids) == args.max_tokens
    await asyncio.sleep(1)
    base = {name: rss_mib(pid) for name, pid in pids.items()}
    ttft, itl, errors, done, tokens = [], [], Counter(), 0, 0
    end = time.monotonic() + args.seconds

    async def one_stream(i: int) -> None:
        nonlocal done, tokens
        n = 0
        while time.monotonic() < end:
            n += 1
            req = request(i, n)
            t0 = last = time.perf_counter()
            got, finish = 0, ""
            try:
                async for msg in client.generate_stream(req, timeout=300):
                    now = time.perf_counter()
                    finish = msg.finish_reason or finish
                    if msg.token_ids:
                        if got == 0:
                            ttft.append(now - t0)
                        else:
                            itl.append((now - last) / len(msg.token_ids))
                        got += len(msg.token_ids)
                        last = now
                if got != args.max_tokens and not (args.real and finish == "stop" and got > 0):
                    errors[f"short stream ({got} tokens, {finish or 'no finish reason'})"] += 1
                else:
                    done += 1
                tokens += got
            except SpecdecError as exc:  # the status, as the client names it
                errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(one_stream(i) for i in range(args.streams)))
    wall = time.monotonic() - t0
    after = {name: rss_mib(pid) for name, pid in pids.items()}
    await asyncio.sleep(args.settle)
    settled = {name: rss_mib(pid) for name, pid in pids.items()}
    await client.close()

    models = f"specdec up (embedded default, {args.threads} threads)" if args.real else f"k={args.k}, tiny models"
    print(f"# {args.streams} streams x {args.seconds:g} s, {args.max_tokens} tokens per request, {models}, loopback")
    print(f"completed streams: {done}; tokens: {tokens} ({tokens / wall:.0f} tokens/s over {wall:.1f} s)")
    print(f"errors: {sum(errors.values())}" + "".join(f"\n  {n} x {e}" for e, n in errors.most_common()))
    print(f"time to first token: p50 {pct(ttft, 50) * 1e3:.1f} ms, p99 {pct(ttft, 99) * 1e3:.1f} ms "
          f"({len(ttft)} streams)")
    print(f"inter-token latency: p50 {pct(itl, 50) * 1e3:.2f} ms, p99 {pct(itl, 99) * 1e3:.2f} ms "
          f"({len(itl)} chunks)")
    print(f"RSS (MiB)      baseline   after load   after {args.settle:g} s settle   kept by design   "
          "within 10% of baseline + kept")
    for name in pids:
        extra = kept(name)
        ok = settled[name] <= base[name] * 1.10 + extra
        print(f"{name:<12} {base[name]:>10.1f} {after[name]:>12.1f} {settled[name]:>21.1f} {extra:>16.1f}   "
              f"{'yes' if ok else 'NO'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--settle", type=float, default=5.0, help="seconds to wait after the load before the last RSS")
    p.add_argument("--real", action="store_true", help="`specdec up` with the embedded default, real prompts")
    p.add_argument("--threads", type=int, default=2, help="--real: `specdec up --threads`")
    p.add_argument("--serve", choices=["draft", "target", "coordinator"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--draft", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port, args.redis_url, args.draft, args.target))
        return 0

    from specdec.app.launcher import RedisServer, free_port, stop_processes

    if args.real:
        return load_real(args)
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPC_VERBOSITY="ERROR")
    redis = RedisServer().start()
    ports = {name: free_port() for name in ("draft", "target", "coordinator")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("draft", "target", "coordinator"):
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "specdec.bench.load", "--serve", name, "--port", str(ports[name]), "--redis-url", redis.url,
                 "--draft", addr["draft"], "--target", addr["target"]], env=env)
        for name in procs:
            asyncio.run(wait_serving(addr[name]))
        pids = {"redis-server": redis.proc.pid, **{name: proc.pid for name, proc in procs.items()}}
        asyncio.run(load(args, addr["coordinator"], pids))
    finally:
        stop_processes(list(procs.values()), 15)
        redis.stop()
    return 0


def target_gauge(name: str, port: int = 9462) -> float:
    """A gauge from the target service's /metrics (specdec up's default metrics port)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return float("nan")


def load_real(args) -> int:
    """`specdec up` (its defaults) in a child, its services' processes measured."""
    import tempfile

    from specdec.app.launcher import free_port, guarded, stop_processes

    ports = [free_port() for _ in range(3)]
    logs = Path(tempfile.mkdtemp(prefix="specdec-load-"))
    argv = [sys.executable, "-m", "specdec", "up", "--port", str(ports[0]), "--draft-port", str(ports[1]),
            "--target-port", str(ports[2]), "--http-port", "-1", "--threads", str(args.threads),
            "--log-dir", str(logs)]
    up = subprocess.Popen(guarded(argv), stdout=open(logs / "up.log", "wb"), stderr=subprocess.STDOUT,
                          cwd=checkout())
    try:
        asyncio.run(wait_serving(f"127.0.0.1:{ports[0]}", timeout=900))
        pids = {process_name(p): p for p in children(up.pid)}
        def kept(name: str) -> float:  # the KV snapshots the target's prefix cache holds
            return target_gauge("specdec_prefix_cache_bytes") / 2**20 if name == "target_service" else 0.0

        asyncio.run(load(args, f"127.0.0.1:{ports[0]}", pids, kept))
        print("kept by design: the KV the target's prefix cache holds (its budget: `specdec up --prefix-cache-mb`, "
              "default 1024)")
    finally:
        stop_processes([up], 60)
    print(f"(the services' logs: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
