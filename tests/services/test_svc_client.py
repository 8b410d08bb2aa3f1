"""`specdec client` (a real process) and CoordinatorClient against real services: resuming after a
cut, waiting for a coordinator that is not ready yet, and a one-line message when none answers."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import pytest

from coordinator.servicer import start_coordinator_server
from specdec.rpc.clients import CoordinatorClient
from specdec.app.launcher import free_port
from specdec.rpc.serving import ServerSettings
from tests.services.stack import FAST, char_text_target, local_stack, run, slow

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    return char_text_target(tmp_path_factory)


async def _cli(*args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "specdec", "client", *args, env=ENV,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


# --- 7. the streaming client says how to resume after a cut ----------------------------------------

def test_the_streaming_client_prints_how_to_resume_after_a_cut_and_the_resume_gives_the_rest(redis_url,
                                                                                           text_target):
    lm, tokenizer_dir = text_target

    async def scenario():
        async with local_stack(redis_url, slow(lm, 20.0), tokenizer_dir=tokenizer_dir) as st:
            done = await _cli("hello", "--no-chat", "--stream", "--max-new-tokens", "12",
                              "--address", st.coord.address)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "specdec", "client", "hello there", "--no-chat", "--stream",
                "--max-new-tokens", "300", "--address", st.coord.address, env=ENV,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            shown = b""
            while len(shown) < 10:  # bounded by run()'s timeout
                shown += await proc.stdout.read(1)
            await st.coord.stop(0)  # the cut: the coordinator goes away mid-stream
            rest_out, err = await asyncio.wait_for(proc.communicate(), 60)
            cut = (proc.returncode, (shown + rest_out).decode(), err.decode())
            coord = await start_coordinator_server(redis_url, [], [t.address for t in st.targets], settings=FAST)
            try:
                m = re.search(r"--session-id (\S+) --resume-from (\d+)", cut[2])
                resumed = await _cli("--session-id", m.group(1), "--resume-from", m.group(2),
                                     "--address", coord.address) if m else None
                client = CoordinatorClient(coord.address)
                full = await client.generate(client.request(session_id=m.group(1))) if m else None
                await client.close()
            finally:
                await coord.stop(0)
            return done, cut, resumed, full

    done, cut, resumed, full = run(scenario(), timeout=240)
    assert done[0] == 0 and re.search(r"session \S+, 12 tokens committed", done[2]), done[2]
    code, printed, err = cut
    assert code != 0 and "resume with: specdec client --session-id" in err, f"no way to resume in {err!r}"
    assert len(err.strip().splitlines()) <= 2, err
    assert resumed[0] == 0, resumed
    assert printed.rstrip("\n") + resumed[1].rstrip("\n") == full.text


# --- 8. a client waits for a coordinator that is not ready yet; none at all: one line ----------------

def test_a_client_started_before_the_coordinator_listens_waits_for_it_within_its_deadline(redis_url, long_target):
    port = free_port()

    async def scenario():
        async with local_stack(redis_url, long_target) as st:
            client = CoordinatorClient(f"127.0.0.1:{port}")
            try:
                unary = asyncio.ensure_future(client.generate(client.request(token_ids=[5, 6, 7], max_tokens=5),
                                                              timeout=60))
                stream = asyncio.ensure_future(_collect(client.generate_stream(
                    client.request(token_ids=[5, 6, 7], max_tokens=5), timeout=60)))
                await asyncio.sleep(1.5)  # both calls are waiting (or, before the fix, already failed)
                late = await start_coordinator_server(redis_url, [], [t.address for t in st.targets],
                                                      ServerSettings(port=port), settings=FAST)
                try:
                    return await unary, await stream
                finally:
                    await late.stop(0)
            finally:
                await client.close()

    unary, chunks = run(scenario())
    assert len(unary.token_ids) == 5 and sum(len(c.token_ids) for c in chunks) == 5


async def _collect(stream) -> list:
    return [ch async for ch in stream]


def test_the_client_with_no_coordinator_says_so_in_one_line_naming_the_address_and_specdec_up():
    address = f"127.0.0.1:{free_port()}"
    code, out, err = asyncio.run(_cli("hello", "--address", address, "--connect-timeout", "1", timeout=60))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert address in err and "specdec up" in err and "failed to connect" not in err, err
