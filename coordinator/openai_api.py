"""OpenAI-compatible HTTP front door of the coordinator: convert, call Coordinator, convert back.

Served on its own port by the coordinator's process and event loop (FastAPI on uvicorn), over the
same session machinery as the gRPC API (`Coordinator.open` / `follow` / `generate`): one generation
path, two front doors. The same bearer token file guards both; TLS is the gRPC port's.

- POST /v1/chat/completions, POST /v1/completions: streaming (server-sent events ending with
  `data: [DONE]`) and not; max_tokens (max_completion_tokens), temperature, top_p, seed, stop,
  n = 1, stream_options.include_usage. The `specdec` request field (ignored by clients that do not
  send it) chooses the method and k, names a session id and the number of generated tokens the
  client already has (resume); the `specdec` response field carries the session id, the tokens
  generated so far and the statistics (method, tau, alpha, target forwards). Standard clients
  ignore both.
- GET /v1/models (the served target and its methods), GET /health (no token), GET /metrics,
  GET /openapi.json (naming the served model).
- Errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 bad input, 401
  missing or wrong token, 404 unknown model or session, 409 a session id holding another request,
  413 a body over the size limit, 429 overloaded, 503 a dependency down; anything else is logged
  and answered 500 "internal error" (no exception text leaves the process).
- A client that disconnects stops the work, as a cancelled gRPC call does: the request leaves the
  session's run, and a run left by its last consumer is cancelled and the session paused.

Defaults follow OpenAI, not the gRPC API: temperature 1 when not given (send 0 for greedy).

Known limitations: no logprobs, tools, echo, best_of or n > 1 (refused); other unknown fields are
ignored; the body size limit is read from Content-Length (a chunked body is not counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Optional, Union

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import (Aborted, FailedPrecondition, InvalidRequest, NotFound, Overloaded, SpecdecError,
                            Unavailable, public_message)
from specdec.types import SamplingParams
from coordinator.core import Coordinator, Prompt, Request
from coordinator.run import SessionRun

log = logging.getLogger("coordinator.http")

MAX_BODY_BYTES = 4 << 20  # as the gRPC port's message limit: a request is a prompt
UNAUTHENTICATED = "missing or invalid bearer token"
OPEN_PATHS = ("/health",)  # no token asked (probes carry none); /metrics and the schema need one on this public port


# --- the wire: OpenAI's request and response shapes (the subset served) -----------------------

class SpecdecOptions(BaseModel):
    """specdec's extension of a request: which method drafts, and which session to continue."""

    method: Optional[str] = Field(None, description="auto (default), draft, target, or a target-side method "
                                                    "(plain, medusa, lookahead, prompt-lookup, ...): GET /v1/models")
    k: Optional[int] = Field(None, ge=0, description="tokens drafted per step (0: the coordinator's default)")
    session_id: Optional[str] = Field(None, description="continue (or name) this session")
    resume_from: int = Field(0, ge=0, description="generated tokens the client already has of that session")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: Union[str, list[TextPart], None] = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerateBody(BaseModel):
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, le=2 ** 64 - 1)
    stop: Union[str, list[str], None] = None
    n: Optional[int] = Field(None, description="only 1 is served")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Any] = Field(None, description="not served: refused unless absent, null or false")
    user: Optional[str] = None
    specdec: Optional[SpecdecOptions] = None


class ChatCompletionRequest(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class CompletionRequest(_GenerateBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = Field(None, description="not served: refused when true")
    best_of: Optional[int] = Field(None, description="only 1 is served")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecdecInfo(BaseModel):
    """specdec's extension of a response (standard clients ignore it)."""

    model_config = ConfigDict(extra="allow")
    session_id: str
    tokens: int = Field(description="generated tokens of the session up to the end of this response or chunk: "
                                    "send it as resume_from to continue after a cut")
    method: Optional[str] = None
    tau: Optional[float] = None
    alpha: Optional[float] = None
    target_forwards: Optional[int] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Optional[str]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: SpecdecInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str]
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    specdec: SpecdecInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    specdec: dict[str, list[str]] = Field(description="methods: what the specdec.method field accepts")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str


_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 429, 503)}
_STATUS = (  # core errors -> (HTTP status, OpenAI error type)
    (InvalidRequest, 400, "invalid_request_error"),
    (NotFound, 404, "not_found_error"),
    (FailedPrecondition, 409, "conflict_error"),
    (Aborted, 409, "conflict_error"),
    (Overloaded, 429, "rate_limit_error"),
    (Unavailable, 503, "service_unavailable"),
)


def error_body(message: str, kind: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_for(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for an exception; the text of unknown ones stays here."""
    for cls, status, kind in _STATUS:
        if isinstance(exc, cls):
            return status, error_body(public_message(exc, kind), kind)
    return 500, error_body("internal error", "internal_error")


# --- conversion at the edge ----------------------------------------------------------------

def _text(content: Union[str, list[TextPart], None]) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _refuse_unserved(body: _GenerateBody) -> None:
    if body.n not in (None, 1):
        raise InvalidRequest(f"n must be 1 (one choice per request), got {body.n}")
    if body.logprobs not in (None, False, 0):
        raise InvalidRequest("logprobs are not served")
    if getattr(body, "echo", None):
        raise InvalidRequest("echo is not served")
    if getattr(body, "best_of", None) not in (None, 1):
        raise InvalidRequest("best_of must be 1")


def completion_prompt(prompt: Union[str, list[str], list[int], list[list[int]]]) -> Prompt:
    """OpenAI's prompt forms -> one Prompt (a batch of prompts is refused)."""
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if prompt and all(isinstance(x, int) for x in prompt):
        return Prompt(token_ids=list(prompt))
    if len(prompt) != 1:
        raise InvalidRequest(f"one prompt per request, got {len(prompt)}")
    only = prompt[0]
    return Prompt(text=only) if isinstance(only, str) else Prompt(token_ids=list(only))


def to_request(body: _GenerateBody, prompt: Prompt, max_tokens: Optional[int]) -> Request:
    _refuse_unserved(body)
    ext = body.specdec or SpecdecOptions()
    sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return Request(prompt=prompt, sampling=sampling, max_tokens=max_tokens or 0, stop=stop,
                   method=ext.method or "", k=ext.k or 0, session_id=ext.session_id or "",
                   resume_from=ext.resume_from)


def specdec_info(run: SessionRun, upto: int, final: bool) -> dict:
    info: dict[str, Any] = {"session_id": run.session_id, "tokens": upto}
    if final:
        s = run.stats
        info.update(method=run.method, tau=s.tau, alpha=s.alpha, target_forwards=s.target_forwards,
                    drafted=s.drafted, accepted=s.accepted, emitted=s.emitted, fallback_steps=s.fallback_steps,
                    tokens_per_s=s.tokens_per_s, elapsed_s=s.elapsed_s)
    return info


def usage(run: SessionRun, offset: int) -> dict:
    completion = len(run.generated) - offset
    return {"prompt_tokens": run.rec.prompt_len, "completion_tokens": completion,
            "total_tokens": run.rec.prompt_len + completion}


@dataclass(frozen=True)
class _Shape:
    """What differs between a chat completion and a text completion on the wire."""

    prefix: str
    object: str
    chunk_object: str

    def choice(self, text: str, finish_reason: Optional[str], first: bool = False, stream: bool = False) -> dict:
        if self.object == "text_completion":
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                    "logprobs": None}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


CHAT = _Shape("chatcmpl-", "chat.completion", "chat.completion.chunk")
TEXT = _Shape("cmpl-", "text_completion", "text_completion")


# --- the app ---------------------------------------------------------------------------------

class _Guard:
    """Before the body is read or any route runs, as the gRPC token interceptor does: the token
    (where one is asked) and the body's declared size. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware (`@app.middleware("http")`) pipes every response through a task of its own."""

    def __init__(self, app, token_file=None):
        self.app, self.token_file = app, token_file

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(Headers(scope=scope), scope["path"])
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, path: str) -> Optional[JSONResponse]:
        if self.token_file is not None and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            if not self.token_file.accepts(token):
                return JSONResponse(error_body(UNAUTHENTICATED, "authentication_error", code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse(error_body(f"the request body is over {MAX_BODY_BYTES} bytes",
                                           "invalid_request_error"), status_code=413)
        return None


def build_app(core: Coordinator, token_file=None) -> FastAPI:
    """The FastAPI app over `core`; `token_file`: a security.TokenFile (None: no token asked)."""
    app = FastAPI(title="specdec OpenAI-compatible API", version="1", openapi_url=None,
                  description="OpenAI-compatible completions over specdec's speculative decoding sessions.")

    app.add_middleware(_Guard, token_file=token_file)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"[:500]
        return JSONResponse(error_body(message, "invalid_request_error", param=where), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail)[:200], kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(SpecdecError)
    async def refused(request, exc: SpecdecError):
        status, body = error_for(exc)
        if status == 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(Exception)  # a bug: Starlette logs it (then re-raises it to uvicorn) and answers this
    async def failure(request, exc: Exception):
        return JSONResponse(error_for(exc)[1], status_code=500)

    async def served_model(name: str) -> str:
        info = await core.info()
        if name != info.name:
            raise NotFound(f"the model {name[:100]!r} does not exist: this server serves {info.name!r}")
        return info.name

    async def answer(request: HttpRequest, body: _GenerateBody, req: Request, shape: _Shape):
        model = await served_model(body.model)
        if body.stream:
            run, offset = await core.open(req)  # errors before the stream starts get their own status
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(core, run, offset, model, shape, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        run, offset = await _unless_disconnected(request, core.generate(req))
        return {"id": shape.prefix + run.session_id, "object": shape.object, "created": int(time.time()),
                "model": model, "choices": [shape.choice(core.text_from(run, offset), run.checker.finish_reason)],
                "usage": usage(run, offset), "specdec": specdec_info(run, len(run.generated), final=True)}

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={200: {"content": _SSE}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest):
        prompt = Prompt(chat=[(m.role, _text(m.content)) for m in body.messages])
        return await answer(request, body, to_request(body, prompt, body.max_completion_tokens or body.max_tokens),
                            CHAT)

    @app.post("/v1/completions", response_model=Completion, responses={200: {"content": _SSE}, **_ERRORS})
    async def completions(body: CompletionRequest, request: HttpRequest):
        return await answer(request, body, to_request(body, completion_prompt(body.prompt), body.max_tokens), TEXT)

    async def model_card() -> dict:
        info = await core.info()
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "specdec",
                "specdec": {"methods": list(core.methods(info))}}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model: str):
        await served_model(model)
        return await model_card()

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        if not core.store_ok or not core.target_pool.live() or core.warming:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(core.metrics.exposition().decode(), media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document():
        """The OpenAPI document, naming the served model once the target has answered."""
        schema = openapi()
        try:
            name = (await core.info()).name
        except SpecdecError:
            return schema
        doc = json.loads(json.dumps(schema))
        for body in ("ChatCompletionRequest", "CompletionRequest"):
            doc["components"]["schemas"][body]["properties"]["model"]["enum"] = [name]
        return doc

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for item in schema["paths"].values():
                for op in item.values():
                    op["responses"].pop("422", None)  # validation errors are answered 400 (OpenAI's shape)
            if token_file is not None:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                for path, item in schema["paths"].items():
                    for op in item.values():
                        op["security"] = [] if path in OPEN_PATHS else [{"bearer": []}]
                        if path not in OPEN_PATHS:
                            op["responses"].setdefault("401", {"description": "missing or invalid bearer token",
                                                               "content": {"application/json": {"schema": {
                                                                   "$ref": "#/components/schemas/ErrorBody"}}}})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _unless_disconnected(request: HttpRequest, work):
    """Await `work`, cancelling it if the client disconnects first (a unary request's cancellation)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result()  # CancelledError when the client left: nobody is there to answer


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _events(core: Coordinator, run: SessionRun, offset: int, model: str, shape: _Shape,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The session's updates as OpenAI stream chunks; an error after the stream began is sent as
    an error event (the status line is gone by then)."""
    base = {"id": shape.prefix + run.session_id, "object": shape.chunk_object, "created": int(time.time()),
            "model": model}
    extra = {"usage": None} if include_usage else {}
    first = True
    try:
        async with contextlib.aclosing(core.follow(run, offset)) as updates:
            async for upd in updates:
                final = bool(upd.finish_reason)
                if not upd.text and not final and not first:
                    continue  # tokens that are not text yet (half a character)
                upto = upd.offset + len(upd.token_ids)
                yield _sse({**base, "choices": [shape.choice(upd.text, upd.finish_reason or None, first, stream=True)],
                            **extra, "specdec": specdec_info(run, upto, final)})
                first = False
        if include_usage:
            yield _sse({**base, "choices": [], "usage": usage(run, offset),
                        "specdec": specdec_info(run, len(run.generated), True)})
        yield b"data: [DONE]\n\n"
    except SpecdecError as exc:
        yield _sse(error_for(exc)[1])
    except Exception as exc:  # noqa: BLE001 - the status line is sent: say so in the stream, keep the text here
        log.error("stream of session %s failed", run.session_id, exc_info=exc)
        yield _sse(error_for(exc)[1])


# --- serving on the coordinator's event loop ------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the coordinator's process owns SIGTERM / SIGINT
    (serving.serve_until_signal), and stops this server with the gRPC one."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RunningHttp:
    server: _Server
    task: asyncio.Task
    port: int
    scheme: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    async def stop(self, grace: float = 0.0) -> None:
        """Refuse new connections, give open ones `grace` seconds, then close them."""
        self.server.config.timeout_graceful_shutdown = max(grace, 0.5)  # 0 would time out with nothing to wait for
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace + 2.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.task, 2.0)


async def start_http_server(core: Coordinator, host: str, port: int, tls=None, token_file=None) -> RunningHttp:
    """Serve the app on host:port (0: any free port) in this event loop. `tls`: a
    security.ServerTLS (with a client CA: mutual TLS, as on the gRPC port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (accepted ones
    # inherit it), and without it Nagle held each response's body behind its headers until the
    # client's delayed ACK: +40 ms a request (72 ms for a one-token answer, 30 of them ours).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen on {host}:{port} for HTTP: {exc.strerror}") from None
    sock.listen(256)
    tls_kw = {}
    if tls is not None:
        tls_kw = dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.client_ca:
            tls_kw.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(build_app(core, token_file), log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5, **tls_kw)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http-server")
    for _ in range(500):  # bounded: 10 s
        if server.started or task.done():
            break
        await asyncio.sleep(0.02)
    if not server.started:
        server.should_exit = True
        sock.close()
        if task.done() and task.exception() is not None:
            raise Unavailable(f"the HTTP server did not start: {type(task.exception()).__name__}")
        raise Unavailable("the HTTP server did not start within 10 s")
    return RunningHttp(server, task, sock.getsockname()[1], "https" if tls is not None else "http")
