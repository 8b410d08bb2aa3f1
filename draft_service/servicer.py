"""gRPC shell of the draft service: convert, call DraftCore, convert back."""

from __future__ import annotations

from specdec.backends.hf import CausalLM
from specdec.rpc import convert
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.serving import RunningServer, ServerSettings, start_server
from specdec.rpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.sessions import check_session_id
from draft_service.core import DraftCore, DraftSettings

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, core: DraftCore):
        self.core = core

    async def Info(self, request, context):
        lm = self.core.draft
        return common_pb2.ModelInfo(name=lm.name, vocab_size=lm.vocab_size, eos_token_ids=list(lm.eos_token_ids),
                                    max_positions=lm.max_positions, max_k=self.core.settings.max_k)

    async def Prefill(self, request, context):
        sid = check_session_id(request.session_id)
        return common_pb2.PrefillResponse(cached_len=await self.core.prefill(sid, request.token_ids))

    async def Propose(self, request, context):
        pos = request.position
        sid = check_session_id(pos.session_id)
        sampling = convert.sampling_from_pb(request.sampling)
        res = await self.core.propose(sid, pos.committed_len, pos.new_token_ids, pos.committed_digest, request.k,
                                      sampling, request.with_guess)
        reply = draft_pb2.ProposeResponse(token_ids=res.token_ids)
        if res.draft_probs is not None:
            reply.draft_probs.CopyFrom(convert.draft_probs_to_pb(res.draft_probs))
        if res.guess is not None:
            reply.guess = res.guess
        return reply

    async def Release(self, request, context):
        sid = check_session_id(request.session_id)
        return common_pb2.ReleaseResponse(released=self.core.release(sid))


async def start_draft_server(draft: CausalLM, server: ServerSettings = ServerSettings(),
                             settings: DraftSettings = DraftSettings()) -> RunningServer:
    """Start the draft service on a model already in memory (tests pass tiny models)."""
    metrics = ServiceMetrics("draft")
    core = DraftCore(draft, settings, metrics)
    running = await start_server(
        server, lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(core), s),
        [SERVICE_NAME], metrics)
    running.core = core
    running.on_stop.append(core.close)
    return running
