"""Async clients of the three services: a deadline on every call, an application-level retry
for calls that are safe to repeat, and status codes turned back into the core's error types.

Retries are done here, not by gRPC's service-config retry policy, which was seen ending calls
early with DEADLINE_EXCEEDED in some fresh processes. Propose, Verify and Decode are
safe to repeat: every call carries the session's committed length and digest, and a service
that already applied a call rolls back to that length before doing it again.

Propose and Verify, a session's per-step calls, travel on one long-lived stream per session and
replica (StepStream; the servers serve `ProposeStream` / `VerifyStream` as streams of the unary
calls, see serving.py) instead of a unary call per step: the same messages, statuses, deadlines
(per message) and retries, without a call's setup on every step. A replica that does not offer
the stream (UNIMPLEMENTED: an older version) is called unary from then on.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Sequence

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import (Aborted, FailedPrecondition, InvalidRequest, NotFound, Overloaded, RemoteError, SpecdecError,
                            Unavailable)
from specdec.rpc import convert
from specdec.rpc.serving import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from specdec.rpc.security import ClientTLS, secure_channel
from specdec.rpc.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2,
                            target_pb2_grpc)
from specdec.types import DecodeResult, DraftBlock, DraftKind, ModelInfo, SamplingParams, Verdict


class DeadlineExceeded(Unavailable):
    """The call did not finish before its deadline."""


class Unauthenticated(SpecdecError):
    """The coordinator refused the call's bearer token (missing, wrong or revoked)."""


_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
}


def error_from(exc: grpc.aio.AioRpcError, address: str) -> SpecdecError:
    cls = _ERRORS.get(exc.code(), RemoteError)
    details = exc.details() or exc.code().name
    if cls in (Unavailable, DeadlineExceeded, RemoteError):
        details = f"{address}: {details}"
    err = cls(details)
    err.code = exc.code()
    return err


@dataclass(frozen=True)
class Deadlines:
    """Seconds allowed per call."""

    info: float = 10.0
    prefill: float = 60.0
    propose: float = 10.0  # the draft's circuit breaker opens when a Propose misses this
    verify: float = 60.0
    decode: float = 120.0
    release: float = 5.0
    health: float = 1.0


# Pings every 2 s while a call is open, the connection closed after 2 s without an answer: a call
# over a link that went dead fails UNAVAILABLE in seconds instead of at its deadline (a minute for a
# Verify), so the session moves to another replica or falls back.
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
                     ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0)]


class StreamEnded(Exception):
    """The server ended a step stream between two calls (it is draining): the call was not made."""


class StepStream:
    """One session's step calls to one replica on a long-lived bidirectional stream: a request,
    then its response, one at a time (concurrent callers take turns). Every request is complete
    in itself, so a stream that fails in any way (an error status, a missed deadline, a caller
    cancelled mid-call, a connection lost) is dropped and the next call opens a new one."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]):
        self._open = open_call
        self._call: Optional[grpc.aio.StreamStreamCall] = None
        self._lock = asyncio.Lock()
        self.answered = 0  # calls answered on the current stream

    async def ask(self, request, timeout: float):
        """-> the response. Raises grpc.aio.AioRpcError (the status that ended the stream),
        TimeoutError (no answer within `timeout`), or StreamEnded."""
        async with self._lock:
            if self._call is None:
                self._call, self.answered = self._open(), 0
            call, ok = self._call, False
            try:
                async with asyncio.timeout(timeout):
                    await call.write(request)
                    reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise StreamEnded()
                ok = True
                self.answered += 1
                return reply
            except asyncio.InvalidStateError:  # written to a stream that had already ended
                raise StreamEnded() from None
            finally:
                if not ok:
                    self._call, self.answered = None, 0
                    call.cancel()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class ServiceClient:
    """`tls`: None for plaintext, else TLS (mutual when it holds a client certificate); `token`: a
    bearer token sent with every call (the coordinator's public API)."""

    # Step streams kept open (one per session: each client class has one step method); beyond
    # this the least recently used idle ones are closed (a session whose run ended closes its own).
    max_streams = 1024

    def __init__(self, address: str, deadlines: Deadlines = Deadlines(), retries: int = 2,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: Optional[ClientTLS] = None,
                 token: Optional[str] = None, step_streams: bool = True):
        self.address = address
        self.deadlines = deadlines
        self.retries = retries
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.channel = secure_channel(address, channel_options(max_message_bytes) + KEEPALIVE_OPTIONS, tls)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.step_streams = step_streams  # False: unary step calls (also once the replica answered UNIMPLEMENTED)
        self._streams: OrderedDict[str, StepStream] = OrderedDict()

    async def _call(self, method, request, timeout: float, retries: Optional[int] = None):
        """Unary call with a deadline; UNAVAILABLE (connection refused, server draining) is retried."""
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return await method(request, timeout=timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < retries:
                    await asyncio.sleep(0.05 * 2 ** attempt)
                    continue
                raise error_from(exc, self.address) from None

    async def _step(self, session_id: str, stream_method, unary_method, request, timeout: float, retries: int):
        """A session's step call on its stream (retried as _call retries; a stream that had
        answered before and is found broken or ended is replaced at once, free of charge: the
        replica restarted or drained between two steps)."""
        if not self.step_streams:
            return await self._call(unary_method, request, timeout, retries)
        attempt = 0
        while True:
            stream = self._streams.get(session_id)
            if stream is None:
                stream = self._streams[session_id] = StepStream(lambda: stream_method(metadata=self.metadata))
                for sid in [s for s, st in self._streams.items() if not st.busy][: len(self._streams) - self.max_streams]:
                    self._streams.pop(sid).close()  # the least recently used idle ones
            self._streams.move_to_end(session_id)
            stale = stream.answered > 0
            try:
                return await stream.ask(request, timeout)
            except StreamEnded:
                if stale:
                    continue
                exc_code, details = grpc.StatusCode.UNAVAILABLE, "the replica ended the stream (draining)"
            except TimeoutError:
                raise DeadlineExceeded(f"{self.address}: no answer within {timeout:g} s") from None
            except grpc.aio.AioRpcError as exc:
                exc_code, details = exc.code(), None
                if exc_code == grpc.StatusCode.UNIMPLEMENTED:
                    self.step_streams = False
                    return await self._call(unary_method, request, timeout, retries)
                if stale and exc_code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    continue
                if exc_code != grpc.StatusCode.UNAVAILABLE or attempt >= retries:
                    raise error_from(exc, self.address) from None
            if exc_code == grpc.StatusCode.UNAVAILABLE and attempt < retries:
                await asyncio.sleep(0.05 * 2 ** attempt)
                attempt += 1
                continue
            raise Unavailable(f"{self.address}: {details}")

    def end_session(self, session_id: str) -> None:
        """Close the session's step stream, if any (its run ended, or it left this replica)."""
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            stream.close()

    async def healthy(self, service: str = "") -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=self.deadlines.health)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        await self.channel.close()


def _info_from(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(name=msg.name, vocab_size=msg.vocab_size, eos_token_ids=tuple(msg.eos_token_ids),
                     max_positions=msg.max_positions, max_k=msg.max_k, methods=tuple(msg.methods),
                     tokenizer_files=dict(msg.tokenizer_files), drafting_cannot_pay=msg.drafting_cannot_pay,
                     verify_cost={int(k): float(v) for k, v in msg.verify_cost.items()})


class DraftClient(ServiceClient):
    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    async def info(self) -> ModelInfo:
        return _info_from(await self._call(self.stub.Info, common_pb2.InfoRequest(), self.deadlines.info))

    async def prefill(self, session_id: str, token_ids: Sequence[int]) -> int:
        req = common_pb2.PrefillRequest(session_id=session_id, token_ids=list(token_ids))
        return (await self._call(self.stub.Prefill, req, self.deadlines.prefill)).cached_len

    async def propose(self, session_id: str, committed: Sequence[int], known_len: int, k: int,
                      sampling: SamplingParams, with_guess: bool = False, vocab_size: int = 0,
                      timeout: Optional[float] = None, digest: Optional[int] = None) -> DraftBlock:
        """digest: token_digest(committed), when the caller keeps it (else computed here)."""
        req = draft_pb2.ProposeRequest(position=convert.position_to_pb(session_id, committed, known_len, digest), k=k,
                                       sampling=convert.sampling_to_pb(sampling), with_guess=with_guess)
        # No retry: a Propose that misses its deadline opens the breaker instead.
        reply = await self._step(session_id, self.stub.ProposeStream, self.stub.Propose, req,
                                 timeout or self.deadlines.propose, retries=0)
        probs = None
        if reply.HasField("draft_probs"):
            probs = convert.draft_probs_from_pb(reply.draft_probs, len(reply.token_ids),
                                                vocab_size or reply.draft_probs.vocab_size)
        # The draft service drafts by argmax under greedy settings and samples otherwise.
        kind = DraftKind.DETERMINISTIC if sampling.greedy else DraftKind.SAMPLED
        return DraftBlock(tuple(reply.token_ids), probs, reply.guess if reply.HasField("guess") else None, kind)

    async def release(self, session_id: str) -> bool:
        self.end_session(session_id)
        req = common_pb2.ReleaseRequest(session_id=session_id)
        return (await self._call(self.stub.Release, req, self.deadlines.release)).released


class TargetClient(ServiceClient):
    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    async def info(self) -> ModelInfo:
        return _info_from(await self._call(self.stub.Info, common_pb2.InfoRequest(), self.deadlines.info))

    async def prefill(self, session_id: str, token_ids: Sequence[int]) -> int:
        req = common_pb2.PrefillRequest(session_id=session_id, token_ids=list(token_ids))
        return (await self._call(self.stub.Prefill, req, self.deadlines.prefill)).cached_len

    async def verify(self, session_id: str, committed: Sequence[int], known_len: int, draft_ids: Sequence[int],
                     draft_probs: Optional[torch.Tensor], sampling: SamplingParams,
                     draft_kind: DraftKind, digest: Optional[int] = None) -> Verdict:
        req = target_pb2.VerifyRequest(position=convert.position_to_pb(session_id, committed, known_len, digest),
                                       draft_token_ids=list(draft_ids), sampling=convert.sampling_to_pb(sampling),
                                       draft_kind=convert.draft_kind_to_pb(draft_kind))
        if draft_probs is not None:
            req.draft_probs.CopyFrom(convert.draft_probs_to_pb(draft_probs))
        reply = await self._step(session_id, self.stub.VerifyStream, self.stub.Verify, req, self.deadlines.verify,
                                 self.retries)
        return Verdict(row_id=0, num_drafted=reply.num_drafted, num_accepted=reply.num_accepted,
                       emitted=tuple(reply.emitted_token_ids))  # (the session's one row)

    async def decode(self, session_id: str, committed: Sequence[int], known_len: int, max_tokens: int,
                     method: str, sampling: SamplingParams, stop_token_ids: Sequence[int] = (),
                     digest: Optional[int] = None) -> DecodeResult:
        req = target_pb2.DecodeRequest(position=convert.position_to_pb(session_id, committed, known_len, digest),
                                       max_tokens=max_tokens, method=method, sampling=convert.sampling_to_pb(sampling),
                                       stop_token_ids=list(stop_token_ids))
        reply = await self._call(self.stub.Decode, req, self.deadlines.decode)
        return DecodeResult(tuple(reply.emitted_token_ids), reply.method, reply.target_forwards, reply.num_drafted,
                            reply.num_accepted)

    async def release(self, session_id: str) -> bool:
        self.end_session(session_id)
        req = common_pb2.ReleaseRequest(session_id=session_id)
        return (await self._call(self.stub.Release, req, self.deadlines.release)).released


# --- the public API ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Completion:
    session_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: dict
    prompt_tokens: int = 0


def _stats(msg: coordinator_pb2.Stats) -> dict:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


@dataclass(frozen=True)
class Chunk:
    session_id: str
    offset: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str = ""
    stats: Optional[dict] = None


class CoordinatorClient(ServiceClient):
    """What applications (and `specdec client`) use. The prompt is exactly one of text (raw),
    token_ids, or chat messages [(role, content), ...]."""

    def __init__(self, address: str, timeout: float = 600.0, **kwargs):
        super().__init__(address, **kwargs)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.timeout = timeout

    @staticmethod
    def request(text: Optional[str] = None, token_ids: Optional[Sequence[int]] = None,
                chat: Optional[Sequence[tuple[str, str]]] = None, *, max_tokens: int = 0,
                sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (), method: str = "",
                k: int = 0, session_id: str = "", resume_from: int = 0) -> coordinator_pb2.GenerateRequest:
        req = coordinator_pb2.GenerateRequest(sampling=convert.sampling_to_pb(sampling), max_tokens=max_tokens,
                                              stop=list(stop), method=method, k=k, session_id=session_id,
                                              resume_from=resume_from)
        if text is not None:
            req.text = text
        elif token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        elif chat is not None:
            req.chat.messages.extend(coordinator_pb2.ChatMessage(role=r, content=c) for r, c in chat)
        return req

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the coordinator accepts a connection within `timeout` seconds (connecting again
        as often as the channel's back-off allows)."""
        try:
            async with asyncio.timeout(timeout):
                await self.channel.channel_ready()
            return True
        except TimeoutError:
            return False

    # wait_for_ready: a coordinator that is starting, restarting or too busy to accept at once
    # (a refused or timed-out connection) is waited for until the call's deadline, not failed at once.
    async def generate(self, req: coordinator_pb2.GenerateRequest, timeout: Optional[float] = None) -> Completion:
        try:
            reply = await self.stub.Generate(req, timeout=timeout or self.timeout, wait_for_ready=True,
                                             metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc, self.address) from None
        return Completion(reply.session_id, reply.text, tuple(reply.token_ids), reply.finish_reason,
                          _stats(reply.stats), reply.prompt_tokens)

    async def generate_stream(self, req: coordinator_pb2.GenerateRequest,
                              timeout: Optional[float] = None) -> AsyncIterator[Chunk]:
        call = self.stub.GenerateStream(req, timeout=timeout or self.timeout, wait_for_ready=True,
                                        metadata=self.metadata)
        try:
            async for msg in call:
                yield Chunk(msg.session_id, msg.offset, tuple(msg.token_ids), msg.text, msg.finish_reason,
                            _stats(msg.stats) if msg.HasField("stats") else None)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc, self.address) from None
        finally:
            call.cancel()
