"""Redis killed (SIGKILL) mid-generation and restarted empty on the same port (issue 16, test 5):
the sessions in flight end with a clear error (UNAVAILABLE with our message, or NOT_FOUND for the
session Redis lost), never a hang or a silent wrong answer; new sessions work at once; no service
is restarted. (test_svc_faults covers Redis lost while idle; this one kills it under streams.)
Real gRPC servers, a real redis-server started and killed here."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.records import STORE_DOWN
from specdec.decode import plain_generate
from specdec.app.launcher import RedisServer
from specdec.types import StopConditions
from tests.conftest import assert_greedy_equal
from tests.services.stack import local_stack, run, slow

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
LONG = 150  # tokens per in-flight session: far more than arrive before the kill
NEW = 16


@pytest.mark.parametrize("down_s", [0.0, 0.3], ids=["back-at-once", "down-0.3s"])
def test_redis_killed_mid_generation_and_back_empty_ends_in_flight_sessions_clearly_and_new_ones_work(
        long_target, good_draft, down_s):
    redis = RedisServer().start()  # our own: this test kills it
    sids = [f"redis-crash-inflight-{i}" for i in range(len(PROMPTS))]

    async def scenario():
        async with local_stack(redis.url, slow(long_target, 10.0), good_draft) as st:
            servers = [id(s.server) for s in (st.coord, *st.drafts, *st.targets)]
            seen = {sid: [] for sid in sids}
            started = {sid: asyncio.Event() for sid in sids}

            async def stream(sid, prompt):
                req = st.client.request(token_ids=prompt, max_tokens=LONG, session_id=sid)
                call = st.client.stub.GenerateStream(req, timeout=60, metadata=st.client.metadata)
                try:
                    async for chunk in call:
                        seen[sid].extend(chunk.token_ids)
                        if len(seen[sid]) >= 3:
                            started[sid].set()
                        if chunk.finish_reason:
                            return grpc.StatusCode.OK, chunk.finish_reason
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
                return None, "the stream ended without a finish reason or an error"

            t0 = time.monotonic()
            tasks = [asyncio.create_task(stream(s, p)) for s, p in zip(sids, PROMPTS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
            redis.kill()
            killed_at = {sid: len(seen[sid]) for sid in sids}
            await asyncio.sleep(down_s)
            redis.start()  # same port, empty (no persistence)
            back = time.monotonic()
            # New sessions at once: the first request after Redis answers PING, no retries (method draft:
            # drafting must resume; auto would choose by measured costs, which say nothing here).
            fresh = await st.client.generate(st.client.request(token_ids=PROMPTS[0], max_tokens=NEW, method="draft"),
                                           timeout=30)
            fresh_s = time.monotonic() - back
            ended = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            ended_s = time.monotonic() - t0
            lost = []
            for sid in sids:  # a lost session: NOT_FOUND when resumed, not an empty success
                try:
                    await st.client.stub.Generate(st.client.request(session_id=sid, resume_from=0), timeout=10,
                                                  metadata=st.client.metadata)
                    lost.append((grpc.StatusCode.OK, ""))
                except grpc.aio.AioRpcError as exc:
                    lost.append((exc.code(), exc.details()))
            more = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=NEW, method="draft"),
                                                             timeout=30) for p in PROMPTS))
            same_servers = servers == [id(s.server) for s in (st.coord, *st.drafts, *st.targets)]
            return (dict(zip(sids, ended)), killed_at, seen, fresh, fresh_s, ended_s, lost, more, same_servers,
                    st.core.draft_pool.live(), st.core.store_ok)

    try:
        ended, killed_at, seen, fresh, fresh_s, ended_s, lost, more, same_servers, live, store_ok = run(scenario(), 150)
    finally:
        redis.stop()

    print(f"\nin flight at the kill (tokens seen): {killed_at}; first new session {fresh_s:.2f} s after Redis was "
          f"back; streams ended {ended_s:.1f} s after they started")
    for sid, (code, details) in ended.items():
        print(f"{sid}: {code} {details!r} after {len(seen[sid])} tokens")
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND), f"{sid}: {code} {details!r}"
        if code == grpc.StatusCode.UNAVAILABLE:
            assert STORE_DOWN in details, f"{sid}: {details!r}"
        else:
            assert sid in details and ("unknown session" in details or "expired or was deleted" in details), details
        assert "Error" not in details and "Traceback" not in details, details
        assert len(seen[sid]) < LONG, f"{sid} finished although its record was lost"
    for sid, prompt in zip(sids, PROMPTS):  # what a client saw before the error was right
        want = plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=LONG))[0].token_ids
        assert_greedy_equal(long_target, prompt, seen[sid], want[:len(seen[sid])])
    for code, details in lost:
        assert code == grpc.StatusCode.NOT_FOUND and "unknown session" in details, (code, details)
    for prompt, out in zip([PROMPTS[0], *PROMPTS], [fresh, *more]):
        want = plain_generate(long_target, [prompt], stop=StopConditions(max_new_tokens=NEW))[0].token_ids
        assert_greedy_equal(long_target, prompt, out.token_ids, want)
    assert fresh.stats["drafted"] > 0 and all(o.stats["drafted"] > 0 for o in more), "drafting did not resume"
    assert same_servers and live and store_ok
