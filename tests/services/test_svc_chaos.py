"""Issue 16, test 6: `specdec up` (redis-server and the three services as real child processes)
while a seeded chaos loop kills -9 a random service every few seconds for 60 s and 16 clients
generate and, when a stream breaks, resume by session id from the tokens they hold. Every
completed output equals plain decoding, and no client ever receives a token twice or misses one
(each resumed stream starts exactly at the client's count)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from specdec.decode import plain_generate
from specdec.rpc.clients import CoordinatorClient
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.test_svc_up import Up, long_models, ready_up  # noqa: F401 - the module fixture is used below

CLIENTS = 16
CHAOS_S = 60.0
MAX_TOKENS = 96
PROMPTS = [[3, 4, 10, 11, 12, 13, 14], [5, 6, 7, 30, 31], [40, 41, 42, 43, 44, 45, 46, 47], [8, 9, 20, 21]]


@pytest.fixture(scope="module")
def chaos_up(tmp_path_factory, long_models):  # noqa: F811
    with ready_up(tmp_path_factory.mktemp("chaos-up"), long_models) as running:
        yield running


async def _one_request(address: str, prompt: list[int], deadline: float) -> tuple[list[int], int, list[str]]:
    """Generate MAX_TOKENS for prompt, resuming by session id after any break, until done or the
    deadline. -> (tokens received, resumes, problems seen: repeated or missing tokens)."""
    got: list[int] = []
    session, resumes, problems = "", 0, []
    while time.monotonic() < deadline:
        client = CoordinatorClient(address)
        try:
            req = client.request(token_ids=prompt, max_tokens=MAX_TOKENS, session_id=session, resume_from=len(got))
            async for ch in client.generate_stream(req, timeout=30):
                session = session or ch.session_id
                if ch.offset != len(got):
                    problems.append(f"chunk at offset {ch.offset}, client holds {len(got)}")
                got += ch.token_ids
                if ch.finish_reason:
                    return got, resumes, problems
        except Exception:  # noqa: BLE001 - a killed service: resume below
            pass
        finally:
            await client.close()
        resumes += 1
        await asyncio.sleep(0.3)
    return got, resumes, problems


async def _client(i: int, address: str, chaos_done: asyncio.Event, deadline: float):
    finished, incomplete = [], 0
    n = 0
    while not chaos_done.is_set() and time.monotonic() < deadline:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        n += 1
        got, resumes, problems = await _one_request(address, prompt, deadline)
        if len(got) == MAX_TOKENS:
            finished.append((prompt, got, resumes, problems))
        else:
            incomplete += 1
    return finished, incomplete


async def _chaos(up: Up, seed: int, done: asyncio.Event) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    kills, t0 = [], time.monotonic()
    while time.monotonic() - t0 < CHAOS_S:
        await asyncio.sleep(rng.uniform(4.0, 7.0))
        name = rng.choice(["draft", "target", "coordinator"])
        try:
            os.kill(await asyncio.to_thread(up.pid, name), signal.SIGKILL)
            kills.append((round(time.monotonic() - t0, 1), name))
        except (ProcessLookupError, AssertionError):  # being restarted right now
            pass
    done.set()
    return kills


def test_random_kills_for_a_minute_lose_and_repeat_no_token_and_outputs_equal_plain(chaos_up, long_models):  # noqa: F811
    target = long_models[0]

    async def scenario():
        done = asyncio.Event()
        deadline = time.monotonic() + CHAOS_S + 150  # the chaos, then the clients finish what they hold
        chaos = asyncio.create_task(_chaos(chaos_up, seed=16, done=done))
        results = await asyncio.gather(*(_client(i, chaos_up.address, done, deadline) for i in range(CLIENTS)))
        return await chaos, results

    kills, results = asyncio.run(asyncio.wait_for(scenario(), CHAOS_S + 240))
    finished = [f for fs, _ in results for f in fs]
    incomplete = sum(n for _, n in results)
    want = {tuple(p): plain_generate(target, [p], stop=StopConditions(max_new_tokens=MAX_TOKENS))[0].token_ids
            for p in PROMPTS}
    resumed = sum(1 for *_, resumes, _ in finished if resumes)
    print(f"\n{len(kills)} kills {kills}; {len(finished)} outputs completed ({resumed} after resuming), "
          f"{incomplete} left incomplete at the deadline")
    assert {name for _, name in kills} == {"draft", "target", "coordinator"}, kills
    assert all(not problems for *_, problems in finished), [p for *_, p in finished if p][:3]
    for prompt, got, _, _ in finished:
        assert_greedy_equal(target, prompt, got, want[tuple(prompt)])
    assert len(finished) >= CLIENTS and resumed > 0, (len(finished), resumed)
    assert chaos_up.proc.poll() is None, "specdec up stopped"
