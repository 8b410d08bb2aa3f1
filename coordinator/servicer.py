"""gRPC shell of the coordinator: convert, call Coordinator, convert back."""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

from specdec.rpc import convert
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.security import ClientTLS, TokenFile
from specdec.rpc.serving import RunningServer, ServerSettings, start_server
from specdec.rpc.v1 import coordinator_pb2, coordinator_pb2_grpc, draft_pb2, target_pb2
from specdec.rpc.clients import DraftClient, TargetClient
from coordinator.core import Coordinator, CoordinatorSettings, Prompt, Request
from coordinator.routing import ReplicaPool
from coordinator.run import RunStats
from coordinator.sessions import SessionStore

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
PUBLIC_MAX_MESSAGE_BYTES = 4 << 20  # a public request is a prompt: larger ones are refused (RESOURCE_EXHAUSTED)
log = logging.getLogger("coordinator")
# The health service names each replica answers SERVING under.
DRAFT_HEALTH = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
TARGET_HEALTH = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def request_from_pb(msg: coordinator_pb2.GenerateRequest) -> Request:
    which = msg.WhichOneof("prompt")
    prompt = Prompt(
        text=msg.text if which == "text" else None,
        token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        chat=[(m.role, m.content) for m in msg.chat.messages] if which == "chat" else None)
    if which is None and not msg.session_id:
        prompt = Prompt(token_ids=[])  # rejected as an empty prompt
    # (no prompt but a session id: resume that session, NOT_FOUND if it does not exist)
    return Request(prompt=prompt, sampling=convert.sampling_from_pb(msg.sampling), max_tokens=msg.max_tokens,
                   stop=tuple(msg.stop), method=msg.method, k=msg.k, session_id=msg.session_id,
                   resume_from=msg.resume_from)


def stats_to_pb(s: RunStats) -> coordinator_pb2.Stats:
    return coordinator_pb2.Stats(tau=s.tau, alpha=s.alpha, tokens_per_s=s.tokens_per_s,
                                 target_forwards=s.target_forwards, drafted=s.drafted, accepted=s.accepted,
                                 emitted=s.emitted, fallback_steps=s.fallback_steps, pipeline_hits=s.pipeline_hits,
                                 pipeline_misses=s.pipeline_misses, elapsed_s=s.elapsed_s)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, core: Coordinator):
        self.core = core

    async def Generate(self, request, context):
        run, offset = await self.core.generate(request_from_pb(request))
        return coordinator_pb2.GenerateResponse(
            session_id=run.session_id, text=self.core.text_from(run, offset), token_ids=run.generated[offset:],
            finish_reason=run.checker.finish_reason or "", stats=stats_to_pb(run.stats),
            prompt_tokens=run.rec.prompt_len)

    async def GenerateStream(self, request, context):
        run, offset = await self.core.open(request_from_pb(request))
        async for upd in self.core.follow(run, offset):
            chunk = coordinator_pb2.GenerateChunk(session_id=run.session_id, offset=upd.offset,
                                                  token_ids=upd.token_ids, text=upd.text,
                                                  finish_reason=upd.finish_reason)
            if upd.stats is not None:
                chunk.stats.CopyFrom(stats_to_pb(upd.stats))
            yield chunk


def replica_pools(draft_addresses: Sequence[str], target_addresses: Sequence[str], settings: CoordinatorSettings,
                  tls: Optional[ClientTLS] = None) -> tuple[ReplicaPool, ReplicaPool]:
    """The draft and target replica sets, each replica reached through its gRPC client (`tls`: the
    coordinator's client certificate for mutual TLS, and the CA it trusts)."""
    clients = {"tls": tls, "step_streams": settings.step_streams}
    draft = ReplicaPool("draft", functools.partial(DraftClient, **clients), DRAFT_HEALTH, settings.draft_cooldown_s,
                        settings.probe_interval_s)
    target = ReplicaPool("target", functools.partial(TargetClient, **clients), TARGET_HEALTH,
                         settings.draft_cooldown_s, settings.probe_interval_s)
    draft.set_addresses(draft_addresses)
    target.set_addresses(target_addresses)
    return draft, target


async def start_coordinator_server(redis_url: str, draft_addresses: Sequence[str], target_addresses: Sequence[str],
                                   server: ServerSettings = ServerSettings(max_message_bytes=PUBLIC_MAX_MESSAGE_BYTES),
                                   settings: CoordinatorSettings = CoordinatorSettings(),
                                   upstream_tls: Optional[ClientTLS] = None,
                                   redis_options: Optional[dict] = None,
                                   http_port: Optional[int] = None, costs=None) -> RunningServer:
    """`upstream_tls`: TLS to the draft and target replicas (with the coordinator's client
    certificate for mutual TLS); `redis_options`: redis-py connection settings beside the URL
    (username, password, ssl_ca_certs, ...); `http_port`: also serve the OpenAI-compatible HTTP
    API there (0: any free port; None: not at all), with the gRPC port's TLS and token file;
    `costs`: the CostStore that keeps drafting's measured acceptance (default: in memory)."""
    metrics = ServiceMetrics("coordinator")
    store = SessionStore(redis_url, ttl_s=settings.session_ttl_s, **(redis_options or {}))
    draft_pool, target_pool = replica_pools(draft_addresses, target_addresses, settings, upstream_tls)
    for pool in (draft_pool, target_pool):
        pool.on_probe = metrics.replicas_live.labels(service=pool.name).set
    core = Coordinator(store, draft_pool, target_pool, settings, metrics, costs=costs)
    core.start()
    http = None
    try:
        if http_port is not None:  # listening before gRPC health says SERVING
            from coordinator.openai_api import start_http_server  # FastAPI only where HTTP is served

            http = await start_http_server(core, server.host, http_port, server.tls,
                                           TokenFile(server.token_file) if server.token_file else None)
        running = await start_server(
            server, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(core), s),
            [SERVICE_NAME], metrics)
    except BaseException:
        if http is not None:
            await http.stop(0)
        await core.close()
        raise
    running.core, running.http = core, http
    if http is not None:  # after the gRPC server drained, with its grace period
        running.on_stop.append(lambda: http.stop(running.stop_grace))
    core.on_store_change = running.set_serving
    running.on_stop.append(core.close)
    return running
