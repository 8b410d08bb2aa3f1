"""Services vs in-process speculative decoding, concurrency, and pipelining, on this machine.

    nice -n 10 python -m specdec.bench.services [--prompts 4] [--max-new-tokens 48] [--k 4] [--delay-ms 50]
                                        [--target DIR] [--draft DIR] [--threads N] [--json OUT]
                                        [--backend auto|hf|fast] [--target-backend llamacpp]

Measures, greedy, on dev prompts (one per category, chat template, first turn):
1. in-process plain_generate and speculative_generate (target + the draft service's default draft);
2. the same prompts through the services: redis-server + target + draft + coordinator, each its
   own process on loopback, one session at a time;
3. 8 concurrent sessions (aggregate tokens/s) vs one at a time, and vs in process with the same
   8 prompts as the rows of one speculative_generate batch;
4. pipelining on vs off, without and with an artificial delay on every target step (a stand-in
   for a busy GPU or a network hop: the target's model sleeps, using no CPU; specdec/bench/slow_service.py);
5. the same coordinator streamed through gRPC and through its OpenAI-compatible HTTP API (SSE):
   tokens/s and time to first token side by side (`--api-only`: just 5, and in-process plain).
Every run is checked token for token against plain decoding. Numbers are tokens/s of generated
tokens, wall clock, including prompt processing. The per-step overhead of the services is their
wall time per target step minus in-process speculative decoding's: at 1 session against one
prompt at a time, at N sessions (aggregate wall per session step) against N rows batched.

`--profile` runs only in-process speculative (1 and N batched), services and services N concurrent (interleaved)
and prints where a target step's time goes through the services: the coordinator's step phases
(Propose and Verify as its client sees them, the Redis commit, waking the streams, the rest of
the loop; detokenizing), each service's handler time and model-thread time per call (the
difference between the client's view and the handler's is the wire: serialization, HTTP/2,
event-loop hops), the time outside steps (session open, prefill, the client's call), and the
CPU each process burned per target step (from /proc). `--pin` gives the target's process a core of
its own (the rest share the others): what four processes sharing two cores cost its model thread.

Pipelining hides at most min(draft time, verify time) per hit, and a hit needs the whole block
and the guessed bonus accepted; `--draft-delay-ms` makes the draft slower to show where it pays
(e.g. a draft on another machine). The coordinator therefore runs it only with --pipeline, and
only after a fully accepted block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

def load_prompts(tokenizer, n: int) -> list[list[int]]:
    from specdec.models import format_prompt

    if tokenizer is None:  # a model without a tokenizer (a plumbing check on a tiny model)
        return [[(7 * i + j) % 50 + 2 for j in range(8 + i)] for i in range(n)]
    from specdec.prompt_sets import read_prompt_rows

    rows = read_prompt_rows()
    picked, seen = [], set()
    for r in rows:  # one per category first, then more
        if r["category"] not in seen:
            seen.add(r["category"])
            picked.append(r)
    picked += [r for r in rows if r not in picked]
    return [format_prompt(tokenizer, r["turns"][0])[-256:] for r in picked[:n]]


class Timed:
    """A stand-in that times some methods of the object it wraps (the in-process profile)."""

    def __init__(self, inner, spans: dict[str, float], *names: str):
        self._inner, self._spans, self._names = inner, spans, names

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._names:
            return attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self._spans[name] = self._spans.get(name, 0.0) + time.perf_counter() - t0
        return timed


def in_process_run(target, draft, prompts, n, k, method, batched=False):
    """One prompt at a time, or (batched) all prompts as the rows of one speculative_generate:
    in process, concurrent sessions are rows of one batch, the services' equivalent of N sessions."""
    from specdec.decode import plain_generate, speculative_generate
    from specdec.proposers import DraftModelProposer
    from specdec.types import StopConditions

    stop = StopConditions(max_new_tokens=n, eos_token_ids=target.eos_token_ids)
    t0, results, spans = time.perf_counter(), [], {}
    for p in ([prompts] if batched else [[p] for p in prompts]):
        if method == "plain":
            results += plain_generate(target, p, stop=stop)
        else:
            proposer = Timed(DraftModelProposer(draft), spans, "propose")
            results += speculative_generate(Timed(target, spans, "prefill", "forward"), proposer, p, stop=stop, k=k)
    el = time.perf_counter() - t0
    toks = sum(len(r.token_ids) for r in results)
    return dict(tokens=toks, seconds=el, tok_s=toks / el, outputs=[list(r.token_ids) for r in results], spans=spans,
                target_forwards=sum(r.stats.target_forwards for r in results),
                tau=sum(r.stats.emitted for r in results) / max(1, sum(r.stats.target_forwards for r in results)))


class Procs:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *argv: str, log: Path, cpus: Optional[set[int]] = None) -> subprocess.Popen:
        """cpus: the CPUs the process (and every thread it starts) may run on; None: any."""
        from specdec.app.launcher import guarded

        proc = subprocess.Popen(guarded([sys.executable, *argv], cpus), stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self):
        from specdec.app.launcher import stop_processes

        stop_processes(self.procs, 20)


async def through(address, prompts, n, k, concurrent=False):
    from specdec.rpc.clients import CoordinatorClient

    client = CoordinatorClient(address)
    try:
        reqs = [client.request(token_ids=p, max_tokens=n, k=k) for p in prompts]
        t0 = time.perf_counter()
        if concurrent:
            outs = await asyncio.gather(*(client.generate(r) for r in reqs))
        else:
            outs = [await client.generate(r) for r in reqs]
        el = time.perf_counter() - t0
    finally:
        await client.close()
    toks = sum(len(o.token_ids) for o in outs)
    stats = {key: sum(o.stats[key] for o in outs) for key in ("target_forwards", "emitted", "drafted", "accepted",
                                                              "pipeline_hits", "pipeline_misses")}
    return dict(tokens=toks, seconds=el, tok_s=toks / el, outputs=[list(o.token_ids) for o in outs],
                tau=stats["emitted"] / max(1, stats["target_forwards"]), **stats)


async def streamed(api: str, address: str, prompts, n, k):
    """One prompt at a time, streamed through gRPC (`address` host:port) or the HTTP API (a base
    URL): tokens/s over the whole run and the median time to the first text."""
    import statistics

    ttft, texts, outputs, toks = [], [], [], 0
    t0 = time.perf_counter()
    if api == "grpc":
        from specdec.rpc.clients import CoordinatorClient

        client = CoordinatorClient(address)
        try:
            for p in prompts:
                start, first, ids = time.perf_counter(), None, []
                async for ch in client.generate_stream(client.request(token_ids=p, max_tokens=n, k=k)):
                    if first is None and ch.text:
                        first = time.perf_counter() - start
                    ids += ch.token_ids
                ttft.append(first or 0.0)
                outputs.append(ids)
                toks += len(ids)
        finally:
            await client.close()
    else:
        import httpx

        async with httpx.AsyncClient(base_url=address, timeout=600) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            for p in prompts:
                start, first, text, used = time.perf_counter(), None, "", 0
                body = {"model": model, "prompt": p, "max_tokens": n, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "specdec": {"k": k}}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            used = chunk["usage"]["completion_tokens"]
                        for c in chunk["choices"]:
                            if first is None and c["text"]:
                                first = time.perf_counter() - start
                            text += c["text"]
                ttft.append(first or 0.0)
                texts.append(text)
                toks += used
    el = time.perf_counter() - t0
    return dict(tokens=toks, seconds=el, tok_s=toks / el, ttft_s=statistics.median(ttft), outputs=outputs,
                texts=texts)


def scrape(port: int) -> dict[tuple, float]:
    """A service's /metrics -> {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def cpu_seconds(pid: int, tid: int = 0) -> float:
    """User + system CPU time of a process (or one of its threads) so far (Linux /proc)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process, as 'name:tid' (Python's threads are all called python)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[f"{(task / 'comm').read_text().strip()}:{task.name}"] = cpu_seconds(pid, int(task.name))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


class Profiler:
    """Metrics and CPU of the services around one run -> the per-target-step breakdown."""

    def __init__(self, metrics_ports: dict[str, int], pids: dict[str, int]):
        self.metrics_ports, self.pids = metrics_ports, pids

    def snapshot(self, coordinator: str) -> dict:
        """(`coordinator`: which of the coordinators the run goes through.)"""
        ports = {"coordinator": self.metrics_ports[coordinator], "draft": self.metrics_ports["draft"],
                 "target": self.metrics_ports["target"]}
        pids = {"coordinator": self.pids[coordinator],
                **{n: pid for n, pid in self.pids.items() if not n.startswith("c_")}}
        return dict(metrics={n: scrape(p) for n, p in ports.items()},
                    cpu={n: cpu_seconds(pid) for n, pid in pids.items()},
                    threads={n: thread_cpu(pids[n]) for n in ("coordinator", "draft", "target")})

    def measure(self, fn, coordinator: str):
        before = self.snapshot(coordinator)
        res = fn()
        after = self.snapshot(coordinator)
        res["profile"] = self.breakdown(before, after, res)
        return res

    @staticmethod
    def breakdown(before: dict, after: dict, res: dict) -> dict:
        def d(service, name, **labels):
            key = (name, tuple(sorted(labels.items())))
            return after["metrics"][service].get(key, 0.0) - before["metrics"][service].get(key, 0.0)

        steps = max(1, res["target_forwards"])
        ms = lambda x: 1000 * x / steps  # noqa: E731 - seconds in total -> ms per target step
        out = {"wall": ms(res["seconds"])}
        for phase in ("open", "prefill", "propose", "verify", "commit", "commit wait", "notify", "step", "detokenize"):
            out[f"coord {phase}"] = ms(d("coordinator", "specdec_step_phase_seconds_sum", phase=phase))
        for svc, method in (("draft", "Propose"), ("target", "Verify")):
            out[f"{svc} handler"] = ms(d(svc, "specdec_request_latency_seconds_sum", method=method, code="OK"))
            out[f"{svc} model"] = ms(d(svc, "specdec_model_busy_seconds_total"))
            out[f"{svc} batches"] = d(svc, "specdec_batch_size_count") / steps
        for name in after["cpu"]:
            out[f"cpu {name}"] = ms(after["cpu"][name] - before["cpu"][name])
        for proc, threads in after["threads"].items():
            busy = {t: ms(c - before["threads"][proc].get(t, 0.0)) for t, c in threads.items()}
            out[f"threads {proc}"] = ", ".join(f"{t} {c:.1f}" for t, c in sorted(busy.items(), key=lambda x: -x[1])
                                               if c >= 0.05)
        return out


def print_profile(results: dict, spec: dict, batched: dict, concurrency: int) -> None:
    """The per-target-step timeline of the services runs against in-process speculative decoding
    (one session: one prompt at a time; N sessions: N rows of one batch)."""
    base = 1000 * spec["seconds"] / max(1, spec["target_forwards"])
    base_n = 1000 * batched["seconds"] / max(1, batched["target_forwards"])
    print(f"\n## per target step (ms), in-process speculative: {base:.1f} ms per step, tau {spec['tau']:.2f}; "
          f"{concurrency} rows batched: {base_n:.1f} ms per row step (aggregate)")
    cols = [n for n in results if "profile" in results[n]]
    print("| | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    prof = [results[n]["profile"] for n in cols]
    n_sessions = [concurrency if "concurrent" in n else 1 for n in cols]

    def row(label, fn):
        print(f"| {label} | " + " | ".join(fn(p, n) for p, n in zip(prof, n_sessions)) + " |")

    f = lambda x: f"{x:.2f}"  # noqa: E731
    steps = max(1, spec["target_forwards"])
    print("in process: " + ", ".join(f"{name} {1000 * t / steps:.2f}" for name, t in spec["spans"].items())
          + f", rest {base - 1000 * sum(spec['spans'].values()) / steps:.2f} (ms per target step)")
    row("wall per target step (aggregate)", lambda p, n: f(p["wall"]))
    row("overhead vs in process (wall per step - in process, as many rows batched)",
        lambda p, n: f(p["wall"] - (base_n if n > 1 else base)))
    row("coordinator: Propose (client view)", lambda p, n: f(p["coord propose"]))
    row("  draft handler", lambda p, n: f(p["draft handler"]))
    row("  draft model thread (batches per step)", lambda p, n: f"{p['draft model']:.2f} ({p['draft batches']:.2f})")
    row("  wire + client stack (Propose)", lambda p, n: f(p["coord propose"] - p["draft handler"]))
    row("  draft handler minus model", lambda p, n: f(p["draft handler"] - p["draft model"]))
    row("coordinator: Verify (client view)", lambda p, n: f(p["coord verify"]))
    row("  target handler", lambda p, n: f(p["target handler"]))
    row("  target model thread (batches per step)", lambda p, n: f"{p['target model']:.2f} ({p['target batches']:.2f})")
    row("  wire + client stack (Verify)", lambda p, n: f(p["coord verify"] - p["target handler"]))
    row("  target handler minus model", lambda p, n: f(p["target handler"] - p["target model"]))
    row("coordinator: Redis commit (+ wake streams)", lambda p, n: f(p["coord commit"] + p["coord notify"]))
    row("coordinator: step waits for a commit", lambda p, n: f(p["coord commit wait"]))
    row("coordinator: rest of the step", lambda p, n: f(p["coord step"] - p["coord propose"] - p["coord verify"]
                                                        - p["coord commit wait"]))
    row("coordinator: detokenize for streams", lambda p, n: f(p["coord detokenize"]))
    row("outside steps", lambda p, n: f(p["wall"] * n - p["coord step"]))
    row("  coordinator: open the session", lambda p, n: f(p["coord open"]))
    row("  coordinator: prefill draft and target", lambda p, n: f(p["coord prefill"]))
    row("  rest (client call, release, waits)", lambda p, n: f(p["wall"] * n - p["coord step"] - p["coord open"]
                                                               - p["coord prefill"]))
    for name in [k[4:] for k in prof[0] if k.startswith("cpu ")]:
        row(f"CPU {name}", lambda p, n, name=name: f(p[f"cpu {name}"]))
    for name in ("coordinator", "draft", "target"):
        row(f"CPU {name} by thread", lambda p, n, name=name: p[f"threads {name}"])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=50.0, help="artificial delay per target step")
    ap.add_argument("--draft-delay-ms", type=float, default=0.0,
                    help="artificial delay per drafted token (a slower draft: what pipelining can hide)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--target", default=None, help="target directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="draft directory (default: the draft service's default)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--backend", default="auto", choices=["auto", "hf", "fast"],
                    help="how every process runs its model (the services' --backend; default auto)")
    ap.add_argument("--target-backend", default=None, choices=["auto", "hf", "fast", "llamacpp"],
                    help="the target's backend, in process and in its service (default: --backend; llamacpp: the "
                         "GGUF on llama.cpp, the draft staying on torch)")
    ap.add_argument("--service-flags", default="",
                    help="extra flags for the draft and target services, e.g. '--batch-window-ms 2'")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions; the median is reported")
    ap.add_argument("--json", default=None, help="also write every run's numbers here")
    ap.add_argument("--log-dir", default="runs/bench-services")
    ap.add_argument("--api-only", action="store_true",
                    help="only gRPC vs HTTP streaming (and in-process plain, the reference output)")
    ap.add_argument("--profile", action="store_true",
                    help="only in-process speculative and services at 1 and N sessions, with the per-step breakdown")
    ap.add_argument("--pin", action="store_true",
                    help="Linux: the target service and the in-process runs on the last CPU, every other process "
                         "(draft, coordinators, Redis, this client during services runs) on the others: what the "
                         "processes sharing the cores costs the target's model thread")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="with --profile: also a coordinator started with these extra flags, e.g. "
                         "'serial commit=--no-commit-behind' (measured in the same interleaved rounds)")
    args = ap.parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin needs at least 2 CPUs")
    return args


class Stack:
    """redis-server, a draft, a target (and with the full run a slowed target) and the
    coordinators the run compares, each its own process on loopback. `alone`/`rest`: with
    --pin, the target's CPU and everyone else's."""

    def __init__(self, args: argparse.Namespace):
        from specdec.app.launcher import RedisServer, free_port

        self.args = args
        cpus = sorted(os.sched_getaffinity(0))
        self.alone, self.rest = ({cpus[-1]}, set(cpus[:-1])) if args.pin else (None, None)
        self.logs = Path(args.log_dir)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs = Procs()
        self.redis = RedisServer().start()
        if args.pin:
            os.sched_setaffinity(self.redis.proc.pid, self.rest)
        self.variants = dict(v.split("=", 1) for v in args.variant) if args.profile else {}
        self.vnames = {name: f"c_v{i}" for i, name in enumerate(self.variants)}
        self.coords = {"c_plain": ("target", False)}  # coordinator -> (its target, pipelined)
        if not (args.api_only or args.profile):
            self.coords.update(c_pipe=("target", True), c_slow=("target_slow", False),
                               c_slow_pipe=("target_slow", True))
        self.coords.update({c: ("target", False) for c in self.vnames.values()})
        names = ("draft", "target", "target_slow", *self.coords)
        self.ports = {name: free_port() for name in names}
        # --profile reads the draft's, the target's and the coordinators' metrics.
        self.mports = ({name: free_port() for name in ("draft", "target", "c_plain", *self.vnames.values())}
                       if args.profile else {})
        self.http_url = f"http://127.0.0.1:{free_port()}"
        self.started: dict[str, subprocess.Popen] = {}
        self.health: dict[str, str] = {}

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _start(self, name: str, service: str, *argv: str, cpus=None) -> None:
        self.started[name] = self.procs.start(*argv, "--host", "127.0.0.1", "--port", str(self.ports[name]),
                                              "--metrics-port", str(self.mports.get(name, -1)),
                                              log=self.logs / f"{name}.log", cpus=cpus)
        self.health[name] = f"specdec.rpc.v1.{service}"

    def start(self, target_backend: str) -> "Stack":
        from specdec.app.launcher import _wait_serving

        a = self.args
        threads = ["--threads", str(a.threads)] if a.threads else []
        slow = ("-m", "specdec.bench.slow_service")
        draft = ((*slow, "draft", "--delay-ms", str(a.draft_delay_ms)) if a.draft_delay_ms else ("-m", "draft_service"))
        self._start("draft", "DraftService", *draft, *(["--draft", a.draft] if a.draft else []), *threads,
                    "--backend", a.backend, *a.service_flags.split(), cpus=self.rest)
        # (no history drafts: every configuration sends the same prompts, and a later one would draft the
        # answers of an earlier one)
        target = [*(["--target", a.target] if a.target else []), *threads, "--backend", target_backend,
                  "--history-tokens", "0", *a.service_flags.split()]
        self._start("target", "TargetService", "-m", "target_service", *target, cpus=self.alone)
        if "c_slow" in self.coords:
            self._start("target_slow", "TargetService", *slow, "target", "--delay-ms", str(a.delay_ms), *target,
                        cpus=self.alone)
        extra = {c: self.variants[v].split() for v, c in self.vnames.items()}
        http_port = self.http_url.rsplit(":", 1)[1]
        for name, (tgt, pipe) in self.coords.items():
            self._start(name, "Coordinator", "-m", "coordinator", "--http-port", http_port if name == "c_plain" else "-1",
                        "--redis-url", self.redis.url, "--draft-replicas", self.addr("draft"),
                        "--target-replicas", self.addr(tgt), "--pipeline" if pipe else "--no-pipeline",
                        *extra.get(name, []), cpus=self.rest)

        async def wait_all():
            for name, proc in self.started.items():
                await _wait_serving(self.addr(name), self.health[name], proc, timeout=900)

        asyncio.run(wait_all())
        return self

    def stop(self) -> None:
        self.procs.stop()
        self.redis.stop()


def configurations(args, stack: Stack, target, draft, prompts) -> dict:
    """The runs to interleave, by name (each returns its numbers)."""
    n, k, many = args.max_new_tokens, args.k, [prompts[i % len(prompts)] for i in range(args.concurrency)]
    via = lambda c, ps=prompts, conc=False: lambda: asyncio.run(through(stack.addr(c), ps, n, k, conc))  # noqa: E731
    batched, conc, d = (f"in-process speculative, {args.concurrency} batched", f"services, {args.concurrency} concurrent",
                        f"{args.delay_ms:g}")
    inproc = {
        "in-process plain": lambda: in_process_run(target, draft, prompts, n, k, "plain"),
        "in-process speculative": lambda: in_process_run(target, draft, prompts, n, k, "speculative"),
        batched: lambda: in_process_run(target, draft, many, n, k, "speculative", batched=True),
    }
    api = {
        "services, gRPC stream": lambda: asyncio.run(streamed("grpc", stack.addr("c_plain"), prompts, n, k)),
        "services, HTTP stream (OpenAI API)": lambda: asyncio.run(streamed("http", stack.http_url, prompts, n, k)),
    }
    if args.api_only:
        return {"in-process plain": inproc["in-process plain"], **api}
    if args.profile:
        pids = {"draft": stack.started["draft"].pid, "target": stack.started["target"].pid,
                "redis": stack.redis.proc.pid, "bench client": os.getpid(),
                **{c: stack.started[c].pid for c in stack.coords}}
        prof = Profiler(stack.mports, pids)
        out = {"in-process speculative": inproc["in-process speculative"], batched: inproc[batched]}
        for label, c in [("", "c_plain"), *((f" [{v}]", c) for v, c in stack.vnames.items())]:
            out[f"services{label}"] = lambda c=c: prof.measure(via(c), c)
            out[f"{conc}{label}"] = lambda c=c: prof.measure(via(c, many, True), c)
        return out
    return {**inproc, "services": via("c_plain"), conc: via("c_plain", many, True),
            "services, pipelined": via("c_pipe"), f"services, target +{d} ms/step": via("c_slow"),
            f"services, target +{d} ms/step, pipelined": via("c_slow_pipe"), **api}


def interleaved(configs: dict, rounds: int, stack: Stack) -> dict[str, list[dict]]:
    """Every configuration once a round, so a noisy neighbour hits all of them alike."""
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name, fn in configs.items():
            if stack.args.pin:  # in process: the target's CPU, alone; a client of the services: with the rest
                os.sched_setaffinity(0, stack.alone if name.startswith("in-process") else stack.rest)
            runs.setdefault(name, []).append(fn())
            print(f"round {r + 1} {name}: {runs[name][-1]['tok_s']:.2f} tok/s", flush=True)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    from draft_service.models import load_draft
    from specdec.models import load_model

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up children
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target_backend = args.target_backend or args.backend
    loaded = load_model(args.target, backend=target_backend)
    draft = load_draft(args.draft, backend=args.backend)
    prompts = load_prompts(loaded.tokenizer, args.prompts)
    print(f"# {len(prompts)} prompts x {args.max_new_tokens} tokens, k={args.k}, {args.rounds} interleaved rounds, "
          f"target {loaded.lm.name}, draft {draft.name}, draft delay {args.draft_delay_ms:g} ms, backend "
          f"{args.backend}, target backend {target_backend}", flush=True)
    stack = Stack(args)
    try:
        stack.start(target_backend)
        for name in stack.coords:  # warm-up: first forward passes, tokenizer
            asyncio.run(through(stack.addr(name), prompts[:1], 4, args.k))
        asyncio.run(streamed("http", stack.http_url, prompts[:1], 4, args.k))
        runs = interleaved(configurations(args, stack, loaded.lm, draft, prompts), args.rounds, stack)
    finally:
        stack.stop()
    report(args, runs, loaded.tokenizer)
    if args.json:
        Path(args.json).write_text(json.dumps({name: [{kk: vv for kk, vv in r.items() if kk != "outputs"} for r in rs]
                                               for name, rs in runs.items()}, indent=1))
    return 0


def report(args, runs: dict[str, list[dict]], tokenizer) -> None:
    """Per configuration the run with the median tokens/s, checked against plain decoding, and
    the ratios the benchmark is for."""
    results = {name: sorted(rs, key=lambda x: x["tok_s"])[len(rs) // 2] for name, rs in runs.items()}
    spec = results.get("in-process speculative", results.get("in-process plain"))
    plain = results["in-process plain"]["outputs"] if "in-process plain" in results else spec["outputs"]
    plain_text = [tokenizer.decode(o, skip_special_tokens=True) if tokenizer else "" for o in plain]
    print("\n| run (median of rounds) | tokens | s | tok/s | vs in-process speculative | tau | pipeline hits/misses "
          "| time to first token | greedy == plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        same = (all(t == plain_text[i % len(plain)] for i, t in enumerate(r["texts"])) if r.get("texts")
                else all(o == plain[i % len(plain)] for i, o in enumerate(r["outputs"])))
        hm = f"{r.get('pipeline_hits', '-')}/{r.get('pipeline_misses', '-')}"
        ttft = f"{r['ttft_s'] * 1000:.0f} ms" if "ttft_s" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        print(f"| {name} | {r['tokens']} | {r['seconds']:.1f} | {r['tok_s']:.2f} | {r['tok_s'] / spec['tok_s']:.2f}x "
              f"| {tau} | {hm} | {ttft} | {'yes' if same else 'NO'} |")
    if "services, gRPC stream" in results:
        g, h = results["services, gRPC stream"], results["services, HTTP stream (OpenAI API)"]
        print(f"\nHTTP / gRPC streaming: {h['tok_s'] / g['tok_s']:.2f}x tokens/s; time to first token "
              f"{h['ttft_s'] * 1000:.0f} vs {g['ttft_s'] * 1000:.0f} ms")
    if args.api_only:
        return
    single = results["services"]["tok_s"]
    conc_name = f"services, {args.concurrency} concurrent"
    conc = results[conc_name]["tok_s"]
    per_step = lambda r: 1000 * r["seconds"] / max(1, r["target_forwards"])  # noqa: E731
    base, one = per_step(spec), per_step(results["services"])
    batched = results[f"in-process speculative, {args.concurrency} batched"]
    base_n, many_n = per_step(batched), per_step(results[conc_name])
    # What a step through the services adds to the same step in process: at 1 session, wall per
    # target step; at N sessions, wall per session step of the aggregate (N concurrent sessions
    # against N rows of one in-process batch, so the sharing of the model is in both).
    print(f"\nper-step overhead (services minus in process, ms): 1 session {one - base:+.1f} per target step "
          f"({one:.1f} vs {base:.1f}); {args.concurrency} sessions {many_n - base_n:+.1f} per session step "
          f"({many_n:.1f} vs {base_n:.1f} in process as one batch of {args.concurrency})")
    print(f"{args.concurrency} concurrent sessions through services / in process as one batch: "
          f"{conc / batched['tok_s']:.2f}x")
    print(f"through services / in-process speculative: {single / spec['tok_s']:.2f}x")
    print(f"{args.concurrency} concurrent sessions / one at a time: {conc / single:.2f}x")
    if args.profile:
        print_profile(results, spec, batched, args.concurrency)
    else:
        print_pipelining(results, single, args.delay_ms)


def print_pipelining(results: dict, single: float, delay_ms: float) -> None:
    d = f"{delay_ms:g}"
    slow, slow_pipe = results[f"services, target +{d} ms/step"], results[f"services, target +{d} ms/step, pipelined"]
    print(f"pipelining gain, no delay: {results['services, pipelined']['tok_s'] / single:.2f}x; "
          f"with +{d} ms/step: {slow_pipe['tok_s'] / slow['tok_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
