"""gRPC shell of the target service: convert, call TargetCore, convert back."""

from __future__ import annotations

import asyncio
from typing import Optional

from specdec.backends.hf import CausalLM
from specdec.rpc import convert
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.serving import RunningServer, ServerSettings, start_server
from specdec.rpc.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.sessions import check_session_id
from specdec.service.sync import Position
from target_service.core import TargetCore, TargetSettings

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def _position(msg: common_pb2.SessionPosition) -> tuple[str, Position]:
    sid = check_session_id(msg.session_id)
    return sid, Position(msg.committed_len, tuple(msg.new_token_ids), msg.committed_digest)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, core: TargetCore):
        self.core = core

    async def Info(self, request, context):
        lm = self.core.target
        return common_pb2.ModelInfo(name=lm.name, vocab_size=lm.vocab_size, eos_token_ids=list(lm.eos_token_ids),
                                    max_positions=lm.max_positions, tokenizer_files=self.core.tokenizer_files(),
                                    methods=self.core.available_methods(), max_k=self.core.settings.max_k,
                                    drafting_cannot_pay=self.core.drafting_cannot_pay(),
                                    verify_cost=self.core.verify_cost())

    async def Prefill(self, request, context):
        sid = check_session_id(request.session_id)
        return common_pb2.PrefillResponse(cached_len=await self.core.prefill(sid, request.token_ids))

    async def Verify(self, request, context):
        sid, pos = _position(request.position)
        sampling = convert.sampling_from_pb(request.sampling)
        k = len(request.draft_token_ids)
        probs = None
        if not sampling.greedy and request.HasField("draft_probs"):
            probs = convert.draft_probs_from_pb(request.draft_probs, k, self.core.target.vocab_size)
        res = await self.core.verify(sid, pos, request.draft_token_ids, probs, sampling,
                                     convert.draft_kind_from_pb(request.draft_kind))
        return target_pb2.VerifyResponse(emitted_token_ids=res.emitted, num_accepted=res.num_accepted,
                                         num_drafted=res.num_drafted)

    async def Decode(self, request, context):
        sid, pos = _position(request.position)
        out = await self.core.decode(sid, pos, request.max_tokens, request.method,
                                     convert.sampling_from_pb(request.sampling), request.stop_token_ids)
        return target_pb2.DecodeResponse(emitted_token_ids=out.emitted, method=out.method,
                                         target_forwards=out.target_forwards, num_drafted=out.num_drafted,
                                         num_accepted=out.num_accepted)

    async def Release(self, request, context):
        sid = check_session_id(request.session_id)
        return common_pb2.ReleaseResponse(released=await self.core.release(sid))


async def start_target_server(target: CausalLM, server: ServerSettings = ServerSettings(),
                              settings: TargetSettings = TargetSettings(), tokenizer_dir: Optional[str] = None,
                              methods=None, costs=None, executor=None) -> RunningServer:
    """Start the target service on a model already in memory (tests pass tiny models). costs: the
    CostStore its automatic choices read (default: the user's cache folder); executor: the one
    thread the model runs on (built there too: see target_service.__main__)."""
    metrics = ServiceMetrics("target")

    def make() -> TargetCore:
        return TargetCore(target, settings, metrics, tokenizer_dir=tokenizer_dir, methods=methods, costs=costs,
                          executor=executor)

    core = make() if executor is None else await asyncio.get_running_loop().run_in_executor(executor, make)
    running = await start_server(
        server, lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(core), s),
        [SERVICE_NAME], metrics)
    running.core = core
    running.on_stop.append(core.close)
    return running
