"""In-process service stacks for the service tests: draft, target(s) and coordinator as grpc.aio
servers on loopback ports in the test's own event loop, talking to a real redis-server."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

from specdec.bench.slow_service import SlowLM
from coordinator.core import CoordinatorSettings
from coordinator.servicer import start_coordinator_server
from draft_service.core import DraftSettings
from draft_service.servicer import start_draft_server
from specdec.backends.hf import CausalLM
from specdec.rpc.clients import CoordinatorClient
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.security import ClientTLS
from specdec.rpc.serving import RunningServer, ServerSettings
from target_service.core import TargetSettings
from target_service.servicer import start_target_server

# Quick breaker and health probing so failure tests take seconds, not minutes.
FAST = CoordinatorSettings(draft_cooldown_s=0.2, probe_interval_s=0.1, propose_deadline_s=5.0, target_wait_s=20.0)


@dataclass
class LocalStack:
    redis_url: str
    target_lm: CausalLM
    draft_lm: Optional[CausalLM]
    target_settings: TargetSettings
    drafts: list[RunningServer] = field(default_factory=list)
    targets: list[RunningServer] = field(default_factory=list)
    coord: Optional[RunningServer] = None
    client: Optional[CoordinatorClient] = None

    @property
    def core(self):
        return self.coord.core

    async def restart_draft(self, i: int = 0) -> RunningServer:
        """Start a fresh draft service (empty caches) on the port of draft i."""
        port = self.drafts[i].port
        await self.drafts[i].stop(0)
        self.drafts[i] = await start_draft_server(self.draft_lm, ServerSettings(port=port))
        return self.drafts[i]

    async def raw_session(self, session_id: str, prompt: list[int]):
        """The first draft's and target's raw gRPC stubs (for calls no client would send), with
        the session prefilled on both -> (draft stub, target stub, the session's Position message)."""
        from specdec.rpc import convert
        from specdec.rpc.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

        d = draft_pb2_grpc.DraftServiceStub(self.core.draft_pool.replicas[self.drafts[0].address].client.channel)
        t = target_pb2_grpc.TargetServiceStub(self.core.target_pool.replicas[self.targets[0].address].client.channel)
        for stub in (t, d):
            await stub.Prefill(common_pb2.PrefillRequest(session_id=session_id, token_ids=prompt), timeout=10)
        return d, t, convert.position_to_pb(session_id, prompt, len(prompt))

    async def start_target_on(self, port: int) -> RunningServer:
        srv = await start_target_server(self.target_lm, ServerSettings(port=port), self.target_settings)
        self.targets.append(srv)
        return srv


@asynccontextmanager
async def local_stack(redis_url: str, target_lm: CausalLM, draft_lm: Optional[CausalLM] = None, n_targets: int = 1,
                      settings: CoordinatorSettings = FAST, target_settings: TargetSettings = TargetSettings(),
                      draft_settings: DraftSettings = DraftSettings(), methods=None,
                      inner: ServerSettings = ServerSettings(), outer: Optional[ServerSettings] = None,
                      upstream_tls: Optional[ClientTLS] = None, client_tls: Optional[ClientTLS] = None,
                      token: Optional[str] = None, redis_options: Optional[dict] = None,
                      http_port: Optional[int] = None, tokenizer_dir: Optional[str] = None, target_costs=None,
                      coordinator_costs=None):
    """`inner`: the draft's and target's server settings (TLS), `outer`: the coordinator's (TLS,
    tokens); `upstream_tls`: how the coordinator reaches draft and target; `client_tls`, `token`:
    how the test's client reaches the coordinator; `http_port`: serve the OpenAI-compatible HTTP API
    too (0: a free port; `stack.coord.http.url`); `tokenizer_dir`: the tokenizer the targets serve;
    `target_costs`: the CostStore the targets' automatic choices read (default: the suite's);
    `coordinator_costs`: the one the coordinator keeps drafting's acceptance in (default: memory)."""
    stack = LocalStack(redis_url, target_lm, draft_lm, target_settings)
    try:
        if draft_lm is not None:
            stack.drafts.append(await start_draft_server(draft_lm, inner, settings=draft_settings))
        for _ in range(n_targets):
            stack.targets.append(await start_target_server(target_lm, inner, settings=target_settings,
                                                           methods=methods, tokenizer_dir=tokenizer_dir,
                                                           costs=target_costs))
        coord_kw = {} if outer is None else {"server": outer}
        stack.coord = await start_coordinator_server(redis_url, [d.address for d in stack.drafts],
                                                     [t.address for t in stack.targets], settings=settings,
                                                     upstream_tls=upstream_tls, redis_options=redis_options,
                                                     http_port=http_port, costs=coordinator_costs, **coord_kw)
        stack.client = CoordinatorClient(stack.coord.address, tls=client_tls, token=token)
        yield stack
    finally:
        if stack.client is not None:
            await stack.client.close()
        for srv in [stack.coord, *stack.drafts, *stack.targets]:
            if srv is not None:
                await srv.stop(0)


def slow(lm: CausalLM, delay_ms: float = 10.0) -> SlowLM:
    """The model with a sleep in every call: steps slow enough to act in the middle of a session."""
    return SlowLM(lm, delay_ms / 1000)


TEXT_VOCAB = 128  # the vocabulary size of a target that goes with save_char_tokenizer's tokenizer


def save_char_tokenizer(directory) -> str:
    """A character-level tokenizer (printable ASCII, spaces as "▁", a plain chat template) saved
    to `directory`, so coordinator tests can send text; ids stay below TEXT_VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "\u2581": 2, **{chr(c): c - 30 for c in range(33, 127)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(str(directory))
    return str(directory)


def char_text_target(tmp_path_factory, max_positions: int = 512):
    """A tiny target without EOS (it runs to max_tokens) and a character tokenizer the coordinator
    fetches from it: (lm, tokenizer directory), for tests that send text."""
    from specdec.testing import tiny_llama

    lm = tiny_llama(seed=0, vocab_size=TEXT_VOCAB, num_layers=2, hidden_size=48, eos_token_id=None,
                    max_positions=max_positions)
    return lm, save_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer"))


async def status_of(call) -> tuple[object, str]:
    """(status code, message) a call ends with: (OK, "") when it succeeds; a raw stub's
    AioRpcError and our clients' errors (which carry the status code they map) alike."""
    import grpc

    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    except Exception as exc:  # noqa: BLE001 - our clients map status codes to error types
        return getattr(exc, "code", None), str(exc)
    return grpc.StatusCode.OK, ""


def handled(metrics: ServiceMetrics, method: str) -> float:
    """gRPC calls of `method` a service has answered OK so far."""
    return sum(s.value for s in metrics.request_latency.collect()[0].samples
               if s.name.endswith("_count") and s.labels == {"method": method, "code": "OK"})


def mean_batch_size(metrics: ServiceMetrics) -> float:
    """Sessions per model forward so far, from a service's batch-size histogram."""
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in metrics.batch_size.collect()[0].samples}
    return samples["sum"] / samples["count"]


def run(coro, timeout: float = 120.0):
    """Run one test scenario in a fresh event loop, bounded in time."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())
