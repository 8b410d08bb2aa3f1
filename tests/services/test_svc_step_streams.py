"""A session's Propose and Verify calls travel on one long-lived stream per replica (StepStream,
served by the shared server plumbing as a stream of the unary calls): the same answers and
statuses as unary calls, a fresh stream after any failure, unary calls to a replica without
streams, and no stream keeps a stopping server waiting."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

from draft_service.servicer import start_draft_server
from specdec.errors import NotFound, Unavailable
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.rpc.serving import ServerSettings
from specdec.rpc.v1 import target_pb2_grpc
from specdec.types import DraftKind, SamplingParams
from target_service.core import TargetCore
from target_service.servicer import TargetServicer, start_target_server
from tests.conftest import assert_greedy_equal, plain
from tests.services.stack import FAST, handled, local_stack, run

PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams()
SID = "session-1"


def _count_opens(stub, name: str) -> list[int]:
    """Count the streams a client's stub opens for `name` (wrapping the stub's multi-callable)."""
    opened = [0]
    inner = getattr(stub, name)

    def opening(*args, **kwargs):
        opened[0] += 1
        return inner(*args, **kwargs)

    setattr(stub, name, opening)
    return opened


def test_a_sessions_steps_travel_on_one_stream_to_each_service(redis_url, tiny_target, tiny_draft):
    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft) as st:
            await st.client.generate(st.client.request(token_ids=[1, 2, 3], max_tokens=2, method="draft"))  # warm
            [draft] = st.core.draft_pool.replicas.values()
            [target] = st.core.target_pool.replicas.values()
            proposes = _count_opens(draft.client.stub, "ProposeStream")
            verifies = _count_opens(target.client.stub, "VerifyStream")
            verified_before = handled(st.targets[0].metrics, "Verify")
            out = await st.client.generate(st.client.request(token_ids=PROMPT, max_tokens=40, method="draft"))
            verified = handled(st.targets[0].metrics, "Verify") - verified_before
            return out, proposes[0], verifies[0], verified, len(draft.client._streams) + len(target.client._streams)

    out, proposes, verifies, verified, left_open = run(scenario())
    assert out.stats["target_forwards"] >= 5
    assert verified == out.stats["target_forwards"], "every step is one Verify, timed as such by the target"
    assert (proposes, verifies) == (1, 1), "one stream per session and service, for all its steps"
    assert left_open == 0, "a finished session's streams are closed"


def test_an_error_on_a_stream_has_the_unary_status_and_the_next_call_opens_a_new_stream(tiny_target):
    async def scenario():
        srv = await start_target_server(tiny_target, ServerSettings(port=0))
        client = TargetClient(srv.address)
        opens = _count_opens(client.stub, "VerifyStream")
        try:
            with pytest.raises(NotFound):  # the unary call's status: the caller prefills and calls again
                await client.verify(SID, PROMPT, len(PROMPT), [10, 11], None, GREEDY, DraftKind.DETERMINISTIC)
            await client.prefill(SID, PROMPT)
            first = await client.verify(SID, PROMPT, len(PROMPT), [10, 11], None, GREEDY, DraftKind.DETERMINISTIC)
            committed = PROMPT + list(first.emitted)
            second = await client.verify(SID, committed, len(PROMPT), [], None, GREEDY, DraftKind.DETERMINISTIC)
            return first, second, opens[0]
        finally:
            await client.close()
            await srv.stop(0)

    first, second, opens = run(scenario())
    assert 1 <= len(first.emitted) <= 3 and len(second.emitted) == 1
    assert opens == 2, "the failed stream was dropped; both good calls shared the next one"


def test_a_replica_without_step_streams_is_called_unary(tiny_target):
    async def scenario():
        # A server without specdec's plumbing (an older replica): VerifyStream is UNIMPLEMENTED.
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(TargetCore(tiny_target, methods={})), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = TargetClient(f"127.0.0.1:{port}")
        try:
            await client.prefill(SID, PROMPT)
            first = await client.verify(SID, PROMPT, len(PROMPT), [10], None, GREEDY, DraftKind.DETERMINISTIC)
            return first, client.step_streams
        finally:
            await client.close()
            await server.stop(0)

    first, streams = run(scenario())
    assert len(first.emitted) >= 1
    assert streams is False


def test_stopping_a_server_ends_its_idle_streams_at_once(tiny_target):
    async def scenario():
        srv = await start_target_server(tiny_target, ServerSettings(port=0))
        client = TargetClient(srv.address)
        try:
            await client.prefill(SID, PROMPT)
            await client.verify(SID, PROMPT, len(PROMPT), [10], None, GREEDY, DraftKind.DETERMINISTIC)
            t0 = time.monotonic()
            await srv.stop(10.0)  # the open stream is idle: nothing to wait for
            stopped_in = time.monotonic() - t0
            with pytest.raises(Unavailable):
                await client.verify(SID, PROMPT, len(PROMPT), [10], None, GREEDY, DraftKind.DETERMINISTIC)
            return stopped_in
        finally:
            await client.close()
            await srv.stop(0)

    assert run(scenario()) < 3.0


def test_a_stream_to_a_restarted_replica_is_replaced_without_failing_the_call(tiny_draft):
    """Propose is never retried (a failure opens the draft's breaker), so a stream broken while
    idle must be replaced before the call counts as failed."""
    async def scenario():
        srv = await start_draft_server(tiny_draft, ServerSettings(port=0))
        port = srv.port
        client = DraftClient(srv.address)
        try:
            await client.prefill(SID, PROMPT)
            before = await client.propose(SID, PROMPT, len(PROMPT), 3, GREEDY)
            await srv.stop(0)
            srv = await start_draft_server(tiny_draft, ServerSettings(port=port))
            await client.prefill(SID, PROMPT)  # the new replica rebuilds the session (as the coordinator does)
            after = await client.propose(SID, PROMPT, len(PROMPT), 3, GREEDY)
            return before, after
        finally:
            await client.close()
            await srv.stop(0)

    before, after = run(scenario())
    assert before.token_ids == after.token_ids and len(after.token_ids) == 3


def test_streams_beyond_the_limit_close_the_least_recently_used(tiny_target):
    async def scenario():
        srv = await start_target_server(tiny_target, ServerSettings(port=0))
        client = TargetClient(srv.address)
        client.max_streams = 2
        sids = [f"session-{i}" for i in range(3)]
        try:
            for sid in sids:
                await client.prefill(sid, PROMPT)
                await client.verify(sid, PROMPT, len(PROMPT), [10], None, GREEDY, DraftKind.DETERMINISTIC)
            kept = list(client._streams)
            again = await client.verify(sids[0], PROMPT, len(PROMPT), [10], None, GREEDY, DraftKind.DETERMINISTIC)
            return kept, again
        finally:
            await client.close()
            await srv.stop(0)

    kept, again = run(scenario())
    assert kept == ["session-1", "session-2"]
    assert len(again.emitted) >= 1, "a session whose stream was closed opens a new one"


def test_without_step_streams_the_coordinator_makes_a_unary_call_per_step(redis_url, tiny_target, tiny_draft):
    async def scenario():
        async with local_stack(redis_url, tiny_target, tiny_draft,
                               settings=dataclasses.replace(FAST, step_streams=False)) as st:
            streamed = await st.client.generate(st.client.request(token_ids=PROMPT, max_tokens=24, method="draft"))
            [target] = st.core.target_pool.replicas.values()
            opens = _count_opens(target.client.stub, "VerifyStream")
            out = await st.client.generate(st.client.request(token_ids=PROMPT[1:], max_tokens=24, method="draft"))
            return streamed, out, opens[0]

    first, out, opens = run(scenario())
    assert opens == 0
    assert out.stats["target_forwards"] >= 3
    assert_greedy_equal(tiny_target, PROMPT[1:], out.token_ids, plain(tiny_target, PROMPT[1:], 24).token_ids)
