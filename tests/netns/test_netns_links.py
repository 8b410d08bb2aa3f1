"""Links cut between hosts (issue 16, tests 3 and 4): each service in a network namespace of its
own (conftest.py), a link taken down with `ip link set DEV down` mid-generation. Needs root."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.decode import plain_generate
from specdec.errors import SpecdecError
from specdec.rpc.clients import CoordinatorClient, DeadlineExceeded
from specdec.rpc.serving import Unavailable
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.netns.conftest import TOKEN, netns_model

PROMPT = [5, 6, 7, 8, 9]
N = 400  # generated tokens: long enough to cut a link and see tokens on either side of it


@pytest.fixture(scope="module")
def plain():
    lm = netns_model()
    out = plain_generate(lm, [PROMPT], stop=StopConditions(max_new_tokens=N))[0]
    return lm, list(out.token_ids)


def _client(bed) -> CoordinatorClient:
    return CoordinatorClient(bed.coordinator, tls=bed.client_tls(), token=TOKEN, timeout=120)


async def _read_until(stream, seen: list[int], n: int, session: dict = None) -> dict:
    """Append streamed tokens to `seen` until it holds n (or the stream ends); -> the final stats."""
    while len(seen) < n:
        chunk = await anext(stream)
        assert chunk.offset == len(seen), f"chunk at offset {chunk.offset} after {len(seen)} tokens"
        seen.extend(chunk.token_ids)
        if session is not None:
            session["id"] = chunk.session_id
        if chunk.finish_reason:
            return chunk.stats
    return {}


def test_cut_draft_link_falls_back_to_the_target_and_drafting_resumes(netbed, plain):
    lm, want = plain

    async def scenario():
        client = _client(netbed)
        try:
            stream = client.generate_stream(client.request(token_ids=PROMPT, max_tokens=N, method="draft"))
            seen: list[int] = []
            await _read_until(stream, seen, 20)
            netbed.set_link("draft", up=False)
            try:
                at_cut = len(seen)
                await _read_until(stream, seen, at_cut + 60)  # tokens keep coming: the target alone
                during = len(seen) - at_cut
            finally:
                netbed.set_link("draft", up=True)
            stats = await _read_until(stream, seen, N + 1)
            # Drafting resumes: a new session is drafted again, with no fallback step (bounded wait
            # for the breaker's cool-down and the health probe to let the draft back in).
            after = None
            for _ in range(30):
                after = await client.generate(client.request(token_ids=PROMPT, max_tokens=24, method="draft"), timeout=30)
                if after.stats["fallback_steps"] == 0 and after.stats["drafted"] > 0:
                    break
                await asyncio.sleep(0.5)
            return seen, during, stats, after
        finally:
            await client.close()

    seen, during, stats, after = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert during >= 60
    assert stats["fallback_steps"] > 0, "the cut did not send the session to the target alone"
    assert stats["drafted"] > 0
    assert_greedy_equal(lm, PROMPT, seen, want)
    assert after.stats["fallback_steps"] == 0 and after.stats["drafted"] > 0, "drafting did not resume"
    assert_greedy_equal(lm, PROMPT, after.token_ids, want[:24])


def test_cut_target_link_ends_the_stream_unavailable_in_bounded_time_and_resume_loses_nothing(netbed, plain):
    lm, want = plain
    deadline_s = 60.0

    async def scenario():
        client = _client(netbed)
        try:
            req = client.request(token_ids=PROMPT, max_tokens=N, method="auto")
            stream = client.generate_stream(req, timeout=deadline_s)
            seen: list[int] = []
            session: dict = {}
            await _read_until(stream, seen, 20, session)
            netbed.set_link("target", up=False)
            t_cut = time.monotonic()
            error = None
            try:
                await _read_until(stream, seen, N + 1, session)
            except SpecdecError as exc:
                error = exc
            finally:
                ended_after = time.monotonic() - t_cut
                netbed.set_link("target", up=True)
            # Resume by session id from what the client saw (every chunk named the session).
            rest = None
            for _ in range(20):  # the target is back in the ring shortly after its link (bounded)
                try:
                    rest = await client.generate(client.request(session_id=session["id"], resume_from=len(seen)),
                                                 timeout=60)
                    break
                except Unavailable:
                    await asyncio.sleep(0.5)
            return seen, error, ended_after, rest
        finally:
            await client.close()

    seen, error, ended_after, rest = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert isinstance(error, Unavailable) and not isinstance(error, DeadlineExceeded), repr(error)
    assert ended_after < 30, f"the stream hung {ended_after:.1f} s after the cut"
    assert rest is not None, "the session could not be resumed once the link was back"
    full = seen + list(rest.token_ids)
    assert len(full) == N, f"{len(seen)} seen + {len(rest.token_ids)} resumed != {N}"
    assert_greedy_equal(lm, PROMPT, full, want)
