"""`specdec up` as a real process (redis-server and the three services as its children, tiny models
saved to disk): it says `ready` without warnings while its services start, prints the URL of the
OpenAI-compatible HTTP API (where README's openai-SDK code works), restarts a child that dies (a
stream goes on across a killed draft and a killed target), and says `stopped`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from specdec.decode import plain_generate
from specdec.testing import perturbed_copy, tiny_llama
from specdec.rpc.clients import CoordinatorClient
from specdec.app.launcher import free_port
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import TEXT_VOCAB, save_char_tokenizer

PROMPT = [3, 4, 10, 11, 12, 13, 14]
N = 3000  # long enough to kill a service mid-stream (and wait for its restart) on a slow machine


class Up:
    """A running `specdec up`, its combined output in a file."""

    def __init__(self, tmp, target_dir, draft_dir):
        self.port, self.out_path = free_port(), tmp / "up.out"
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "specdec", "up", "--target", target_dir, "--draft", draft_dir,
                "--port", str(self.port), "--draft-port", str(free_port()), "--target-port", str(free_port()),
                "--http-port", str(free_port()), "--no-metrics", "--timeout", "240"]
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))

    def text(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        """Wait (bounded) until the output from character `after` on matches `pattern`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.text()[after:], re.M)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout} s (exit {self.proc.poll()}):\n{self.text()[-3000:]}")

    def pid(self, name: str) -> int:
        """The pid of the child of `specdec up` now running `name` (target, draft, coordinator)."""
        module = {"target": "target_service", "draft": "draft_service", "coordinator": "coordinator"}[name]
        for _ in range(100):
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as fh:
                for pid in fh.read().split():
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                            if cmd.read().split(b"\0")[2:3] == [module.encode()]:
                                return int(pid)
                    except FileNotFoundError:
                        pass
            time.sleep(0.1)  # being restarted
        raise AssertionError(f"specdec up runs no {name}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    """A tiny target (no EOS, a long context, a character tokenizer) and a draft close to it, on disk."""
    root = tmp_path_factory.mktemp("up-models")
    target = tiny_llama(seed=0, vocab_size=TEXT_VOCAB, num_layers=2, hidden_size=48, eos_token_id=None,
                        max_positions=4096)
    target.model.save_pretrained(root / "target")
    save_char_tokenizer(root / "target")
    perturbed_copy(target, noise=0.05, seed=3).model.save_pretrained(root / "draft")
    return target, str(root / "target"), str(root / "draft")


@contextlib.contextmanager
def ready_up(directory, long_models):
    """A `specdec up` over the long models that has said `ready`; stopped on leaving."""
    running = Up(directory, long_models[1], long_models[2])
    try:
        running.wait_for(r"ready", timeout=240)
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def up(tmp_path_factory, long_models):
    with ready_up(tmp_path_factory.mktemp("up"), long_models) as running:
        yield running


def test_up_says_ready_without_warnings_while_its_services_start(up):
    before_ready = up.text()[: up.wait_for(r"ready", 1).start()]
    assert "WARNING" not in before_ready, before_ready
    assert re.search(r"^specdec up: ready", up.text(), re.M), up.text()


def test_up_prints_the_openai_url_where_the_readme_sdk_code_gets_the_grpc_answer(up):
    import openai

    base_url = up.wait_for(r"^openai api\s+(\S+)", 1).group(1)
    # README "OpenAI-compatible HTTP API", unchanged but for the base URL.
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a haiku."}],
                                            max_tokens=12, temperature=0)
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)

    async def grpc_answers():
        grpc = CoordinatorClient(up.address)
        try:
            return (await grpc.generate(grpc.request(chat=[("user", "Write a haiku.")], max_tokens=12), timeout=60),
                    await grpc.generate(grpc.request(text="Once upon a time", max_tokens=12), timeout=60))
        finally:
            await grpc.close()

    chat_grpc, text_grpc = asyncio.run(asyncio.wait_for(grpc_answers(), 120))
    assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
    assert answer.choices[0].message.content == chat_grpc.text and answer.usage.completion_tokens == 12
    assert text.choices[0].text == text_grpc.text and len(text_grpc.text) > 0


def test_up_restarts_a_killed_draft_and_target_and_the_stream_goes_on(up, long_models):
    async def scenario():
        client = CoordinatorClient(up.address)
        events, chunks, error = [], [], None
        t0 = time.monotonic()
        try:
            async for ch in client.generate_stream(client.request(token_ids=PROMPT, max_tokens=N), timeout=300):
                chunks.append((time.monotonic() - t0, ch))
                n = sum(len(c.token_ids) for _, c in chunks)
                if n >= 30 and not events:
                    os.kill(up.pid("draft"), signal.SIGKILL)
                    events.append(("draft killed", n, time.monotonic() - t0))
                elif n >= 600 and len(events) == 1:
                    os.kill(up.pid("target"), signal.SIGKILL)
                    events.append(("target killed", n, time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - recorded and reported below
            error = exc
        try:
            nxt = await client.generate(client.request(token_ids=PROMPT, max_tokens=20), timeout=120)
        except Exception as exc:  # noqa: BLE001
            nxt = exc
        await client.close()
        return events, chunks, error, nxt

    events, chunks, error, nxt = asyncio.run(asyncio.wait_for(scenario(), 400))
    times = [t for t, _ in chunks]
    gaps = sorted(((b - a, a) for a, b in zip(times, times[1:])), reverse=True)[:2]
    tokens = [t for _, c in chunks for t in c.token_ids]
    print(f"\nevents {events}; {len(tokens)} tokens in {times[-1]:.1f} s; longest gaps {gaps}; "
          f"error {error!r}; finish {chunks[-1][1].finish_reason!r}; next request {nxt!r:.200}")
    assert error is None, f"the stream broke after {len(tokens)} tokens: {error!r}"
    assert [c.offset for _, c in chunks] == [sum(len(c.token_ids) for _, c in chunks[:i]) for i in range(len(chunks))]
    assert len(tokens) == N and chunks[-1][1].finish_reason == "length"
    target = long_models[0]
    want = plain_generate(target, [PROMPT], stop=StopConditions(max_new_tokens=700))[0].token_ids
    assert_greedy_equal(target, PROMPT, tokens[:700], want)  # across the draft's and the target's deaths
    assert not isinstance(nxt, Exception) and nxt.token_ids == tuple(tokens[:20]), nxt
    assert re.search(r"specdec up: draft exited with code -9; restarting", up.text())
    assert re.search(r"specdec up: target restarted \(pid \d+\)", up.text())
    assert up.proc.poll() is None, "specdec up stopped"


def test_up_stops_everything_on_sigterm_and_says_stopped(up):
    children = [up.pid(name) for name in ("target", "draft", "coordinator")]
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert re.search(r"^specdec up: stopped", up.text(), re.M), up.text()[-2000:]
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_up_makes_its_log_dir_or_refuses_before_starting_anything(tmp_path, capsys):
    from specdec.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["up", "--log-dir", str(blocker / "logs")]) == 2
    assert "--log-dir" in capsys.readouterr().err  # refused at once: nothing was started
    logs = tmp_path / "new" / "logs"
    ports = [str(free_port()) for _ in range(4)]
    # A deadline no service can meet: the stack starts and is stopped again, its logs kept.
    assert main(["up", "--log-dir", str(logs), "--timeout", "0.001", "--no-metrics", "--port", ports[0],
                 "--draft-port", ports[1], "--target-port", ports[2], "--http-port", ports[3]]) == 2
    assert sorted(p.name for p in logs.iterdir()) == ["coordinator.log", "draft.log", "target.log"]


def test_a_redis_server_started_by_a_process_killed_by_a_signal_does_not_outlive_it(tmp_path):
    """A test run (or `specdec up`) killed by a signal runs no clean-up: its children die with it."""
    script = ("import os, signal, sys; from specdec.app.launcher import RedisServer; r = RedisServer().start(); "
              "print(r.proc.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL
    pid = int(out.stdout.split()[0])
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not yet reaped by its new parent
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"redis-server {pid} outlived the process that started it")
