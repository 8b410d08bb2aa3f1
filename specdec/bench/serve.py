"""OpenAI-compatible servers side by side, with the same prompts and the same client (the official
`openai` SDK): `specdec up` (the product) and llama-server (llama.cpp's own server, what a CPU user
would run instead; build it with `bash scripts/build-llama-server.sh`), on the same GGUF.

    python -m specdec.bench.serve [--threads 2] [--prompts 2] [--max-tokens 64] [--rounds 2] [--concurrency 1,8]
                          [--stream] [--peer-cache off|on] [--servers specdec,llama-server[,inprocess]]
                          [--specdec-method auto] [--specdec-backend auto|fast|llamacpp]
                          [--workload prompts|two-turn] [--json FILE]
                          [--url NAME=BASE_URL ...]

- Per request: tok/s = completion tokens / wall time of the request (prompt processing included);
  with --stream, time to first token too. Requests go one server at a time, interleaved per
  prompt, round 2 in reverse order (so drift hits both alike); greedy (temperature 0).
- With concurrency c: c client threads send the same requests at once; aggregate tok/s = all
  completion tokens / wall time.
- Texts: how many answers equal the other server's for the same prompt (both run llama.cpp on the
  same file; they may part where two tokens nearly tie, since the kernels a forward uses depend on
  how many tokens it holds).
- `inprocess` is no server: specdec's engine in this process, as `specdec generate` runs it (the
  same prompts and chat template; no HTTP; sequential only).
- The servers are started here (each alone on the machine while measured: the other idles), or
  named with --url (already running). llama-server runs with --cache-ram 0 --no-cache-prompt
  unless --peer-cache on (its default: it reuses the KV of earlier prompts).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specdec.app.launcher import free_port, guarded
from specdec.bench import checkout
from specdec.prompt_sets import read_prompt_rows

ROOT = checkout()

PEER = "llama-server"  # what the ratios and text comparisons are against, when it runs


def peer_of(names: list[str]) -> str:
    """The server the ratios and text comparisons are against: llama-server, else the last named."""
    return PEER if PEER in names else names[-1]
CATEGORIES = ("chat", "code", "math", "qa", "rag", "summarization", "translation")


@dataclass
class Server:
    name: str
    base_url: str
    proc: Optional[subprocess.Popen] = None
    extra_body: dict = field(default_factory=dict)
    engine: object = None  # "inprocess": specdec's Engine in this process, as `specdec generate` runs

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; its log: {log}\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout} s; log: {log}")


def start_specdec(threads: int, logs: Path, method: Optional[str], cache: bool = True, backend: str = "auto",
                  draft_backend: str = "auto", join: bool = False, history: bool = True,
                  cache_any: bool = False) -> Server:
    """`specdec up`; cache False: neither the prefix cache nor the history drafts (nothing of an
    earlier session reused, as llama-server with its cache off); history False: no history drafts;
    cache_any: --prefix-cache-any (exact on llama.cpp now: any prefix is reused by default)."""
    ports = [free_port() for _ in range(4)]
    argv = [sys.executable, "-m", "specdec", "up", "--port", str(ports[0]), "--draft-port", str(ports[1]),
            "--target-port", str(ports[2]), "--http-port", str(ports[3]), "--no-metrics", "--threads", str(threads),
            "--log-dir", str(logs / "specdec"), "--target-backend", backend, "--draft-backend", draft_backend,
            *([] if cache else ["--prefix-cache-mb", "0"]), *([] if cache and history else ["--history-tokens", "0"]),
            *(["--join-sessions"] if join else []), *(["--prefix-cache-any"] if cache_any else [])]
    out = open(logs / "specdec-up.log", "wb")
    proc = subprocess.Popen(guarded(argv), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    _wait_http(f"http://127.0.0.1:{ports[3]}/health", proc, 900, logs / "specdec-up.log")
    return Server("specdec", f"http://127.0.0.1:{ports[3]}/v1", proc,
                  {"specdec": {"method": method}} if method else {})


def llama_server_binary() -> Optional[str]:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build-llama-server.sh"), "--check"], capture_output=True,
                         text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def start_llama_server(binary: str, threads: int, slots: int, cache: bool, logs: Path, extra=()) -> Server:
    from specdec.models import embedded_gguf_path

    port = free_port()
    argv = [binary, "-m", str(embedded_gguf_path()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(2048 * slots), "--no-webui", *extra]
    if not cache:
        argv += ["--cache-ram", "0", "--no-cache-prompt"]
    log = logs / "llama-server.log"
    proc = subprocess.Popen(guarded(argv), stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    _wait_http(f"http://127.0.0.1:{port}/health", proc, 120, log)
    return Server("llama-server", f"http://127.0.0.1:{port}/v1", proc)


def _extras(obj) -> dict:
    """What a server adds beside the OpenAI fields: specdec's `specdec` (method, drafted, accepted,
    target forwards) and llama-server's `timings` (its own prompt and decode milliseconds)."""
    extra = getattr(obj, "model_extra", None) or {}
    return {k: extra[k] for k in ("specdec", "timings") if extra.get(k)}


def start_inprocess(threads: int) -> Server:
    """specdec's engine in this process, as `specdec generate` (defaults) runs: the measured
    backend, method auto, no prefix cache (one prompt a process there)."""
    import torch

    from specdec.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    return Server("inprocess", "", engine=Engine(EngineConfig(prefix_cache_mb=0, history_tokens=0)))


def request_inprocess(engine, prompt: str, max_tokens: int) -> dict:
    from specdec.types import StopConditions

    t0, first = time.perf_counter(), []
    out = engine.complete(prompt, method="auto", stop=StopConditions(max_new_tokens=max_tokens),
                          on_text=lambda piece: first or first.append(time.perf_counter() - t0))
    return {"text": out.text, "tokens": len(out.result.token_ids), "s": time.perf_counter() - t0,
            "ttft": first[0] if first else None}


def request(server: Server, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """One chat completion through the openai SDK -> text, tokens, seconds, ttft (streaming), and
    what the server said of it (_extras)."""
    from openai import OpenAI

    if server.engine is not None:
        return request_inprocess(server.engine, prompt, max_tokens)

    client = OpenAI(base_url=server.base_url, api_key="none", timeout=600, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    t0 = time.perf_counter()
    if not stream:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                             extra_body=server.extra_body or None)
        dt = time.perf_counter() - t0
        return {"text": out.choices[0].message.content, "tokens": out.usage.completion_tokens, "s": dt, "ttft": None,
                **_extras(out)}
    ttft, pieces, tokens, extras = None, [], 0, {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=server.extra_body or None):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        extras.update(_extras(chunk))
    return {"text": "".join(pieces), "tokens": tokens, "s": time.perf_counter() - t0, "ttft": ttft, **extras}


def model_name(server: Server) -> str:
    if server.engine is not None:
        return "inprocess"
    with urllib.request.urlopen(f"{server.base_url}/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def sequential(servers: list[Server], rows: list[dict], args) -> dict:
    """Per server, per prompt id: the requests of every round (interleaved across servers)."""
    models = {s.name: model_name(s) for s in servers}
    for server in servers:  # warm up (first-request costs: loading the tokenizer, the first context)
        request(server, models[server.name], "Hello.", 8, args.stream)
    got: dict[str, dict[str, list[dict]]] = {s.name: {} for s in servers}
    for rnd in range(args.rounds):
        order = rows if rnd % 2 == 0 else rows[::-1]
        for row in order:
            for server in (servers if rnd % 2 == 0 else servers[::-1]):
                r = request(server, models[server.name], row["turns"][0], args.max_tokens, args.stream)
                got[server.name].setdefault(row["id"], []).append({**r, "round": rnd + 1, "category": row["category"]})
                print(f"  round {rnd + 1} {server.name:<12} {row['category']:<13} {r['tokens'] / r['s']:6.1f} tok/s",
                      file=sys.stderr, flush=True)
    return got


def two_turns(servers: list[Server], rows: list[dict], args) -> dict:
    """Per server: the second turn's time to first token and tok/s, after its first turn (the
    conversation re-sent with the answer, as chat clients do), for rows with two turns."""
    from openai import OpenAI

    out = {}
    for server in servers:
        client = OpenAI(base_url=server.base_url, api_key="none", timeout=600, max_retries=0)
        model, ttfts, rates = model_name(server), [], []
        for row in rows:
            first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["turns"][0]}],
                                                   max_tokens=args.max_tokens, temperature=0,
                                                   extra_body=server.extra_body or None)
            messages = [{"role": "user", "content": row["turns"][0]},
                        {"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": row["turns"][1]}]
            t0, ttft, tokens = time.perf_counter(), None, 0
            for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body=server.extra_body or None):
                if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            ttfts.append(ttft or 0.0)
            rates.append(tokens / (time.perf_counter() - t0))
            print(f"  {server.name:<14} {row['id']:<16} second turn: ttft {ttft:.3f} s", file=sys.stderr, flush=True)
        out[server.name] = {"ttft_s": statistics.mean(ttfts), "tok_s": statistics.mean(rates)}
    return out


LATENCY_TOKENS = (1, 2, 16, 64)


def latency(servers: list[Server], row: dict, args, repeats: int = 9) -> dict:
    """Per server, the median seconds of a request for 1, 2, 16 and 64 tokens of one prompt (its
    prompt cached after the first: what is left is a request's fixed cost, the wire and the
    service's loops, and the cost a token), interleaved across servers; printed with the fixed
    cost (1 token) and the ms a token from 2 to 64."""
    models = {s.name: model_name(s) for s in servers}
    times: dict[str, dict[int, list[float]]] = {s.name: {n: [] for n in LATENCY_TOKENS} for s in servers}
    for server in servers:
        request(server, models[server.name], row["turns"][0], 2, args.stream)  # warm-up, and the prompt cached
    for _ in range(repeats):
        for n in LATENCY_TOKENS:
            for server in servers:
                r = request(server, models[server.name], row["turns"][0], n, args.stream)
                times[server.name][n].append(r["s"])
    out = {name: {str(n): statistics.median(ts) for n, ts in per.items()} for name, per in times.items()}
    print(f"# one {row['category']} prompt ({row['id']}), median of {repeats}, {args.threads} threads")
    print(latency_table(out), end="")
    return out


def latency_table(per: dict, label=lambda name: name) -> str:
    """latency()'s medians as a table: ms by answer length, and the ms a token from 2 to 64."""
    sizes = list(next(iter(per.values())))
    lines = ["| server | " + " | ".join(f"{n} tokens, ms" for n in sizes) + " | ms a token (2 to 64) |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for name, v in per.items():
        slope = (v["64"] - v["2"]) / 62 * 1000
        lines.append(f"| {label(name)} | " + " | ".join(f"{v[k] * 1000:.1f}" for k in sizes) + f" | {slope:.2f} |")
    return "\n".join(lines) + "\n"


def concurrent_run(server: Server, rows: list[dict], c: int, args) -> dict:
    model = model_name(server)
    work = [row["turns"][0] for row in rows] * max(1, args.rounds)
    work = (work * ((c + len(work) - 1) // len(work)))[: max(c, len(work))]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        done = list(pool.map(lambda p: request(server, model, p, args.max_tokens, args.stream), work))
    wall = time.perf_counter() - t0
    return {"requests": len(done), "tokens": sum(d["tokens"] for d in done), "wall_s": wall,
            "aggregate_tok_s": sum(d["tokens"] for d in done) / wall}


def report(got: dict, rows: list[dict], names: list[str]) -> dict:
    def rate(name, ids):
        rs = [r for i in ids for r in got[name][i]]
        return sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs)

    table = {}
    for cat in CATEGORIES + ("overall",):
        ids = [r["id"] for r in rows if cat in (r["category"], "overall")]
        if ids:
            table[cat] = {n: rate(n, ids) for n in names}
            ttfts = {n: [r["ttft"] for i in ids for r in got[n][i] if r["ttft"] is not None] for n in names}
            for n in names:
                if ttfts[n]:
                    table[cat][f"{n} ttft_s"] = statistics.mean(ttfts[n])
    peer = peer_of(names)
    equal = {n: sum(got[n][r["id"]][0]["text"] == got[peer][r["id"]][0]["text"] for r in rows)
             for n in names if n != peer}
    return {"per_request_tok_s": table, "texts_equal": equal, "prompts": len(rows), "phases": phases(got, rows, names),
            "requests": got}


def phases(got: dict, rows: list[dict], names: list[str]) -> dict:
    """Where a request's time goes, per category and server, in the client's clock: time to the
    first token (prompt processing + one token + the wire) and milliseconds per later token
    (streaming only); beside them what the server measured itself (llama-server's `timings`:
    prompt and decode ms; specdec: steps that drafted)."""
    out = {}
    for cat in CATEGORIES + ("overall",):
        ids = [r["id"] for r in rows if cat in (r["category"], "overall")]
        for n in names:
            rs = [r for i in ids for r in got[n].get(i, [])]
            timed = [r for r in rs if r["ttft"] is not None and r["tokens"] > 1]
            if not timed:
                continue
            row = {"ttft_s": statistics.mean(r["ttft"] for r in timed),
                   "decode_ms_per_token": 1000 * sum(r["s"] - r["ttft"] for r in timed)
                   / sum(r["tokens"] - 1 for r in timed)}
            served = [r["timings"] for r in timed if "timings" in r]
            if served:  # llama-server's own clock: prompt processing, and ms per decoded token
                row["server_prompt_ms"] = statistics.mean(t.get("prompt_ms", 0.0) for t in served)
                row["server_decode_ms_per_token"] = (sum(t.get("predicted_ms", 0.0) for t in served)
                                                     / max(1, sum(t.get("predicted_n", 0) for t in served)))
            info = [r["specdec"] for r in timed if "specdec" in r]
            if info:
                row["drafted_tokens"] = sum(i.get("drafted", 0) for i in info)
                row["target_forwards"] = sum(i.get("target_forwards", 0) for i in info)
            out.setdefault(cat, {})[n] = row
    return out


def print_phases(summary: dict, names: list[str]) -> None:
    if not summary["phases"]:
        return
    print("\n| where the time goes | " + " | ".join(f"{n} ttft s | {n} ms/token" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for cat, per in summary["phases"].items():
        cells = [f"{per[n]['ttft_s']:.3f} | {per[n]['decode_ms_per_token']:.1f}" if n in per else "- | -" for n in names]
        print(f"| {cat} | " + " | ".join(cells) + " |")
    for n in names:
        row = summary["phases"].get("overall", {}).get(n, {})
        if "server_prompt_ms" in row:
            print(f"{n}'s own clock (overall): prompt {row['server_prompt_ms']:.1f} ms a request, "
                  f"decode {row['server_decode_ms_per_token']:.1f} ms a token")
        if "drafted_tokens" in row:
            print(f"{n}: {row['drafted_tokens']} tokens drafted in {row['target_forwards']} target forwards "
                  "over all streamed requests")


def print_table(summary: dict, names: list[str]) -> None:
    peer = peer_of(names)
    others = [n for n in names if n != peer]
    cols = names + [f"{n} / {peer}" for n in others]
    print("| tok/s per request | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for cat, row in summary["per_request_tok_s"].items():
        cells = [f"{row[n]:.1f}" for n in names] + [f"{row[n] / row[peer]:.2f}x" for n in others]
        print(f"| {cat} | " + " | ".join(cells) + " |")
    for n, same in summary["texts_equal"].items():
        print(f"texts equal, {n} and {peer}: {same} of {summary['prompts']}")


def stamp() -> dict:
    """Where and when the figures were measured: machine, date, the commit of the tree."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or platform.machine())
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return {"machine": f"{cpu}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
            "commit": (rev.stdout.strip() or "unknown") + ("+changes" if dirty else "")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="prompts per category (held-out dev set)")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma list of the categories to send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1", help="comma list, e.g. 1,8 (1: the per-request table only)")
    p.add_argument("--stream", action="store_true", help="stream (and measure time to first token)")
    p.add_argument("--peer-cache", choices=["off", "on"], default="off", help="llama-server's prompt cache")
    p.add_argument("--servers", default="specdec,llama-server",  # also: specdec-nocache, inprocess
                   help="comma list of specdec, specdec-nocache (prefix cache and history drafts off), "
                        "specdec-nohistory (history drafts off), specdec-torchdraft (the draft "
                        "service's draft on torch), specdec-joined (--join-sessions), specdec-anycache "
                        "(--prefix-cache-any), llama-server, inprocess")
    p.add_argument("--specdec-backend", default="auto", help="`specdec up --target-backend` (default auto)")
    p.add_argument("--workload", choices=["prompts", "two-turn", "latency"], default="prompts",
                   help="prompts: the per-request table; two-turn: second turns of two-turn prompts (ttft); "
                        "latency: one chat prompt again and again for 1, 2, 16 and 64 tokens (a request's fixed "
                        "cost and its cost a token)")
    p.add_argument("--specdec-method", default=None, help="the `specdec.method` request field (default: auto)")
    p.add_argument("--url", action="append", default=[], metavar="NAME=BASE_URL", help="a server already running")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    wanted = set(args.categories.split(","))
    if wanted - set(CATEGORIES):
        raise SystemExit(f"--categories: unknown {', '.join(sorted(wanted - set(CATEGORIES)))} "
                         f"(known: {', '.join(CATEGORIES)})")
    rows = [r for cat in CATEGORIES if cat in wanted
            for r in [x for x in read_prompt_rows() if x["category"] == cat][: args.prompts]]
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"specdec-serve-{os.getpid()}"
    (logs / "specdec").mkdir(parents=True, exist_ok=True)
    given = dict(u.split("=", 1) for u in args.url)
    servers = [Server(n, u) for n, u in given.items()]
    for name in [n for n in args.servers.split(",") if n not in given]:
        if name in ("specdec", "specdec-nocache", "specdec-nohistory", "specdec-torchdraft", "specdec-joined",
                    "specdec-anycache"):
            servers.append(start_specdec(args.threads, logs, args.specdec_method, cache=name != "specdec-nocache",
                                         backend=args.specdec_backend,
                                         draft_backend="fast" if name == "specdec-torchdraft" else "auto",
                                         join=name == "specdec-joined", history=name != "specdec-nohistory",
                                         cache_any=name == "specdec-anycache"))
            servers[-1].name = name
        elif name == "inprocess":
            servers.append(start_inprocess(args.threads))
        elif name == "llama-server":
            binary = llama_server_binary()
            if binary is None:
                print("specdec/bench/serve.py: llama-server is not built: run `bash scripts/build-llama-server.sh` "
                      "(~6 minutes on 2 cores); measuring without it", file=sys.stderr)
                continue
            servers.append(start_llama_server(binary, args.threads, max(concurrency), args.peer_cache == "on", logs))
    try:
        names = [s.name for s in servers]
        if args.workload == "latency":
            result = latency(servers, rows[0], args)
            if args.json:
                Path(args.json).write_text(json.dumps({"latency": result, "settings": vars(args), "stamp": stamp()},
                                                      indent=1))
            return 0
        if args.workload == "two-turn":
            pairs = [r for r in read_prompt_rows() if len(r.get("turns", ())) >= 2][: 2 * args.prompts]
            result = two_turns([s for s in servers if s.engine is None], pairs, args)
            print(f"# second turns of {len(pairs)} two-turn prompts, {args.max_tokens} tokens, {args.threads} threads")
            for n, v in result.items():
                print(f"{n}: time to first token {v['ttft_s']:.3f} s, {v['tok_s']:.1f} tok/s")
            if args.json:
                Path(args.json).write_text(json.dumps({"two_turn": result, "settings": vars(args), "stamp": stamp()},
                                                      indent=1))
            return 0
        summary = report(sequential(servers, rows, args), rows, names)
        summary["aggregate"] = {c: {s.name: concurrent_run(s, rows, c, args) for s in servers if s.engine is None}
                                for c in concurrency if c > 1}
        summary["settings"] = vars(args)
        summary["stamp"] = stamp()
        print(f"# {len(rows)} prompts, {args.max_tokens} tokens, {args.rounds} rounds, {args.threads} threads, "
              f"stream {args.stream}, llama-server prompt cache {args.peer_cache}")
        print_table(summary, names)
        print_phases(summary, names)
        for c, per in summary["aggregate"].items():
            print(f"{c} concurrent streams, aggregate tok/s: " +
                  ", ".join(f"{n} {v['aggregate_tok_s']:.1f}" for n, v in per.items()))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        for s in servers:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
