"""Faults found by probing the running services (issue 20): one bad request or one lost
dependency must not take everyone down. Real gRPC servers on loopback, a real redis-server."""

from __future__ import annotations

import logging
import math

import grpc
import pytest

from specdec.testing import tiny_llama
from specdec.rpc.clients import CoordinatorClient
from specdec.rpc.v1 import common_pb2, draft_pb2, target_pb2
from tests.services.stack import char_text_target, local_stack, run, slow, status_of

OK_PROMPT = [5, 6, 7, 8]

BAD_SAMPLING = {
    "temperature inf": (dict(temperature=math.inf), "temperature"),
    "temperature nan": (dict(temperature=math.nan), "temperature"),
    "temperature absurd": (dict(temperature=1e9), "temperature"),
    "temperature negative": (dict(temperature=-1.0), "temperature"),
    "temperature underflows": (dict(temperature=1e-300), "temperature"),
    "top_p nan": (dict(temperature=1.0, top_p=math.nan), "top_p"),
    "top_p above one": (dict(temperature=1.0, top_p=1.5), "top_p"),
    "top_p negative": (dict(temperature=1.0, top_p=-0.1), "top_p"),
    "top_k negative": (dict(temperature=1.0, top_k=-1), "top_k"),
}


def _with_sampling(req, **sampling):
    req.sampling.CopyFrom(common_pb2.SamplingParams(**sampling))  # raw: our SamplingParams would refuse these
    return req


# --- 1. bad sampling values; per-request failures never open the draft's breaker ------------------

def test_non_finite_or_absurd_sampling_is_invalid_argument_at_the_coordinator_draft_and_target(
        redis_url, long_target, good_draft):
    async def scenario():
        async with local_stack(redis_url, long_target, good_draft) as st:
            sid = "session-bad-sampling"
            d, t, pos = await st.raw_session(sid, OK_PROMPT)
            got = {}
            for name, (sampling, _) in BAD_SAMPLING.items():
                bad = common_pb2.SamplingParams(**sampling)
                req = _with_sampling(CoordinatorClient.request(token_ids=OK_PROMPT, max_tokens=8), **sampling)
                got[name] = {
                    "coordinator": await status_of(st.client.stub.Generate(req, timeout=30)),
                    "draft Propose": await status_of(d.Propose(draft_pb2.ProposeRequest(
                        position=pos, k=2, sampling=bad), timeout=10)),
                    "target Verify": await status_of(t.Verify(target_pb2.VerifyRequest(
                        position=pos, draft_token_ids=[3], sampling=bad), timeout=10)),
                    "target Decode": await status_of(t.Decode(target_pb2.DecodeRequest(
                        position=pos, max_tokens=2, sampling=bad), timeout=10)),
                }
            live = st.core.draft_pool.live()
            # (method draft: auto may well decode 12 tokens on the target alone, saying nothing of the draft)
            ok = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=12, method="draft"))
            return got, live, ok

    got, live, ok = run(scenario())
    for name, (_, words) in BAD_SAMPLING.items():
        for where, (code, details) in got[name].items():
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name} at {where}: {code} {details!r}"
            assert words in details and "Error" not in details, f"{name} at {where}: {details!r}"
    assert live, "a bad request took the draft out of the ring"
    assert ok.stats["drafted"] > 0 and ok.stats["fallback_steps"] == 0


def test_a_request_the_draft_refuses_does_not_take_the_draft_from_other_sessions(redis_url, long_target, caplog):
    """A prompt longer than the draft's context is refused by the draft (INVALID_ARGUMENT): that
    session continues on the target alone; every other session keeps drafting."""
    import asyncio

    short_draft = tiny_llama(seed=7, vocab_size=96, num_layers=1, hidden_size=32, max_positions=32,
                             eos_token_id=None)
    long_prompt = [(7 * i) % 90 + 2 for i in range(40)]

    async def scenario():
        async with local_stack(redis_url, slow(long_target), short_draft) as st:
            # method "draft": each session asks the draft at every step (auto might not try it at all)
            big = asyncio.create_task(st.client.generate(st.client.request(token_ids=long_prompt, max_tokens=60,
                                                                           method="draft")))
            while not big.done() and not any(s.generated for s in st.core.runs.values()):  # (bounded by run())
                await asyncio.sleep(0.01)
            small = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=20, method="draft"))
            return await big, small, st.core.draft_pool.live()

    with caplog.at_level(logging.WARNING, logger="coordinator"):
        big, small, live = run(scenario())
    assert big.stats["fallback_steps"] > 0 and len(big.token_ids) == 60
    assert small.stats["fallback_steps"] == 0, "another session's refused request opened the draft's breaker"
    assert live and not [r for r in caplog.records if "out of the ring" in r.getMessage()]


# --- 3. Redis lost and back: health follows it, clients get UNAVAILABLE with our message -----------

async def _wait_health(address: str, serving: bool, timeout: float = 15.0) -> bool:
    """Poll the coordinator's overall health until it is `serving` (bounded); -> whether it got there."""
    import asyncio

    from specdec.rpc.clients import ServiceClient

    probe = ServiceClient(address)
    try:
        for _ in range(int(timeout / 0.1)):
            if await probe.healthy() == serving:
                return True
            await asyncio.sleep(0.1)
        return False
    finally:
        await probe.close()


def test_redis_lost_turns_health_not_serving_and_requests_work_again_once_it_is_back(long_target, good_draft):
    from specdec.app.launcher import RedisServer

    redis = RedisServer().start()  # our own: this test kills it

    async def scenario():
        async with local_stack(redis.url, long_target, good_draft) as st:
            before = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=8))
            redis.kill()
            went_down = await _wait_health(st.coord.address, serving=False)
            failed = await status_of(st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=8),
                                                      timeout=20))
            redis.start()  # same port, empty (no persistence)
            came_back = await _wait_health(st.coord.address, serving=True)
            after = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=8), timeout=20)
            return before, went_down, failed, came_back, after

    try:
        before, went_down, failed, came_back, after = run(scenario())
    finally:
        redis.stop()
    assert went_down, "the coordinator kept saying SERVING without its session store"
    code, details = failed
    assert code == grpc.StatusCode.UNAVAILABLE, failed
    assert "session store" in details and "Error" not in details, details
    assert came_back, "health did not return to SERVING once Redis was back"
    assert after.token_ids == before.token_ids


# --- 2. one huge prompt must not stall everyone ------------------------------------------------------

# A context as long as SmolLM2's tokenizer allows in characters (8192 tokens x 81 characters): the
# largest prompt the coordinator must tokenize before it can tell whether it fits.
LONG_CONTEXT = 131072


@pytest.fixture(scope="module")
def text_target(tmp_path_factory):
    """A tiny target with a long context and a character tokenizer (the coordinator tokenizes text)."""
    return char_text_target(tmp_path_factory, max_positions=LONG_CONTEXT)


async def _latencies_around(st, start_other) -> tuple[list[float], object]:
    """Back-to-back short text requests; after the third, start_other() starts another client's
    call; they go on until it has finished and three more have passed (at most 300).
    -> (the short requests' latencies, the other call's result)."""
    import asyncio
    import time

    out, other, after = [], None, 0
    for _ in range(300):
        t0 = time.perf_counter()
        await st.client.generate(st.client.request(text="hi there", max_tokens=2), timeout=60)
        out.append(time.perf_counter() - t0)
        if len(out) == 3 and start_other is not None:
            other = asyncio.ensure_future(start_other())
        after += other is not None and other.done()
        if (other is None and len(out) >= 20) or after >= 3:
            break
    return out, (await other if other is not None else None)


def test_a_huge_prompt_does_not_stall_other_sessions(redis_url, text_target):
    lm, tokenizer_dir = text_target
    wire_limit = "x" * ((4 << 20) - 4096)  # the largest text the public message size lets through
    longest_token = 5  # "<unk>": the longest entry of the test tokenizer's vocabulary
    size_limit = "ab " * (LONG_CONTEXT * longest_token // 3)  # just under what may fit the context

    async def scenario():
        async with local_stack(redis_url, lm, tokenizer_dir=tokenizer_dir) as st:
            big_client = CoordinatorClient(st.coord.address)
            try:
                quiet, _ = await _latencies_around(st, None)
                got = {}
                for name, text in (("wire limit", wire_limit), ("size limit", size_limit)):
                    got[name] = await _latencies_around(st, lambda: status_of(big_client.generate(
                        big_client.request(text=text, max_tokens=4), timeout=60)))
            finally:
                await big_client.close()
            return quiet, got

    quiet, got = run(scenario())
    allowed = 3 * max(quiet) + 0.5
    print(f"\nshort request latency, quiet: max {max(quiet):.3f} s over {len(quiet)}")
    for name, (lat, status) in got.items():
        print(f"short request latency during the {name} prompt: max {max(lat):.3f} s over {len(lat)}; big: {status}")
    assert got["wire limit"][1][0] == grpc.StatusCode.INVALID_ARGUMENT and "characters" in got["wire limit"][1][1]
    assert got["size limit"][1][0] == grpc.StatusCode.INVALID_ARGUMENT and "context" in got["size limit"][1][1]
    for name, (lat, _) in got.items():
        assert max(lat) <= allowed, f"a {name} prompt stalled another session: {max(lat):.2f} s (quiet {max(quiet):.2f} s)"


# --- 4. a target that stays away: the stream ends with a clear message; the next request works ---------

def test_a_target_that_stays_away_ends_the_stream_with_a_message_naming_the_session(redis_url, long_target,
                                                                                    weak_draft):
    from dataclasses import replace

    from tests.services.stack import FAST

    async def scenario():
        async with local_stack(redis_url, slow(long_target), weak_draft,
                               settings=replace(FAST, target_wait_s=1.0)) as st:
            port, got, error = st.targets[0].port, 0, None
            try:
                async for ch in st.client.generate_stream(st.client.request(token_ids=OK_PROMPT, max_tokens=200)):
                    got += len(ch.token_ids)
                    if got >= 10 and st.targets[0].port == port and not st.targets[0]._stopped:
                        await st.targets[0].stop(0)  # killed, not back within target_wait_s
            except Exception as exc:  # noqa: BLE001 - what the client reads is the point
                error = (getattr(exc, "code", None), str(exc), ch.session_id)
            await st.start_target_on(port)
            nxt = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=8), timeout=30)
            return error, nxt

    error, nxt = run(scenario())
    assert error is not None, "the stream did not end"
    code, message, sid = error
    assert code == grpc.StatusCode.UNAVAILABLE and "target service is unavailable" in message, error
    assert sid in message and "resume" in message, message
    assert len(nxt.token_ids) == 8


# --- 5. resume returns exactly what follows position N, streaming or not ---------------------------------

def test_a_unary_resume_returns_only_the_text_after_the_resume_point(redis_url, text_target):
    from transformers import AutoTokenizer

    lm, tokenizer_dir = text_target
    sid, n = "resume-text-session-01", 12

    async def scenario():
        async with local_stack(redis_url, lm, tokenizer_dir=tokenizer_dir) as st:
            full = await st.client.generate(st.client.request(text="hello world", max_tokens=30, session_id=sid))
            streamed = [ch async for ch in st.client.generate_stream(st.client.request(session_id=sid,
                                                                                        resume_from=n))]
            unary = await st.client.generate(st.client.request(session_id=sid, resume_from=n))
            return full, streamed, unary

    full, streamed, unary = run(scenario())
    before = AutoTokenizer.from_pretrained(tokenizer_dir).decode(list(full.token_ids[:n]), skip_special_tokens=True)
    assert full.text.startswith(before) and len(before) < len(full.text)
    rest = full.text[len(before):]
    assert "".join(ch.text for ch in streamed) == rest
    assert unary.token_ids == full.token_ids[n:]
    assert unary.text == rest, f"the unary resume returned {unary.text!r}, not what follows token {n}: {rest!r}"


# --- 6. a reused session id with another prompt or settings is refused -----------------------------------

def test_a_session_id_reused_with_another_prompt_or_settings_is_refused_and_an_exact_resume_continues(
        redis_url, long_target, good_draft):
    sid = "reused-session-id-0001"

    async def scenario():
        async with local_stack(redis_url, long_target, good_draft) as st:
            first = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=10, session_id=sid))
            other_prompt = await status_of(st.client.generate(st.client.request(token_ids=[9, 10, 11], max_tokens=10,
                                                                              session_id=sid)))
            other_settings = await status_of(st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=12,
                                                                                session_id=sid)))
            exact = await st.client.generate(st.client.request(token_ids=OK_PROMPT, max_tokens=10, session_id=sid,
                                                               resume_from=4))
            return first, other_prompt, other_settings, exact

    first, other_prompt, other_settings, exact = run(scenario())
    for name, (code, details) in (("another prompt", other_prompt), ("other settings", other_settings)):
        assert code == grpc.StatusCode.FAILED_PRECONDITION, f"{name}: {code} {details!r}"
        assert sid in details and "Error" not in details, details
    assert exact.token_ids == first.token_ids[4:]
