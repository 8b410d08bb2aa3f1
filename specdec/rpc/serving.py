"""Server plumbing shared by the draft, target and coordinator services, written once.

- grpc.aio server with message size limits, the standard grpc.health.v1 health service
  (overall "" and each service's own name), server reflection, and Prometheus /metrics on a
  separate port;
- an interceptor that maps errors to status codes: InvalidRequest -> INVALID_ARGUMENT,
  NotFound -> NOT_FOUND, Overloaded -> RESOURCE_EXHAUSTED, Unavailable -> UNAVAILABLE, ...;
  anything else is logged here and reaches the client as INTERNAL "internal error" (no
  exception class or text ever leaves the process); it also times every call;
- step streams: a bidirectional method `<Name>Stream` whose requests and responses are those of
  a unary method `<Name>` is served here, for every service, as a stream of `<Name>` calls: each
  request is answered by the unary handler, in order, timed as a `<Name>` call; an error ends
  the stream with the status the unary call would have had. Services implement only the unary
  method. A long-lived stream per session saves the per-call setup of every step (HTTP/2
  stream, headers, deadline, handler dispatch): see clients.StepStream;
- graceful shutdown on SIGTERM / SIGINT: health goes NOT_SERVING, in-flight calls get a grace
  period, then the server stops;
- settings from flags or a TOML file (`--config FILE`, keys = flag names with underscores;
  flags override the file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import tomllib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import (Aborted, FailedPrecondition, IncompatibleModels, InvalidRequest, ModelLoadError, NotFound,
                            Overloaded, SpecdecError, Unavailable, public_message)
from specdec.service.metrics import ServiceMetrics
from specdec.rpc.security import SecurityConfigError, ServerTLS, TokenAuthInterceptor, TokenFile, check_plaintext_allowed

log = logging.getLogger("specdec.rpc")

DEFAULT_MAX_MESSAGE_BYTES = 32 << 20


_STATUS = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Aborted, grpc.StatusCode.ABORTED),
    (IncompatibleModels, grpc.StatusCode.FAILED_PRECONDITION),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and the one-line message a client may see for an exception."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code, public_message(exc, code.name.lower())
    return grpc.StatusCode.INTERNAL, "internal error"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers to status codes and records call latency."""

    def __init__(self, metrics: Optional[ServiceMetrics] = None):
        self.metrics = metrics
        # Set when the server starts draining: step streams end between two calls (a stream lasts
        # as long as its session, so a draining server would otherwise wait its whole grace period).
        self.draining = asyncio.Event()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is not None and handler.stream_stream and method.endswith("Stream"):
            # The same details under the unary method's name (grpc.aio accepts only its own type here).
            unary = await continuation(type(details)(details.method[: -len("Stream")], details.invocation_metadata))
            if unary is not None and unary.unary_unary:
                return self._step_stream(unary, method[: -len("Stream")])
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        accounted = self._accounted(details.method, method)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                async with accounted(context):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            async with accounted(context):
                async for item in inner_stream(request, context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)

    def _step_stream(self, unary: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
        """`<name>Stream`: each request answered by the unary handler `name`, in order."""
        inner = unary.unary_unary
        accounted = self._accounted(name, name)
        draining = self.draining

        async def steps(request_iterator, context):
            requests = request_iterator.__aiter__()
            stop = asyncio.ensure_future(draining.wait())
            nxt: Optional[asyncio.Future] = None
            try:
                while True:
                    nxt = asyncio.ensure_future(requests.__anext__())
                    await asyncio.wait((nxt, stop), return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():  # draining: end the stream; the client sends the call again elsewhere
                        nxt.cancel()
                        return
                    try:
                        request = nxt.result()
                    except StopAsyncIteration:
                        return
                    async with accounted(context):  # an error aborts the stream with the call's status
                        reply = await inner(request, context)
                    yield reply
            finally:  # the client left, or the stream ended: no read left waiting, none left unread
                stop.cancel()
                if nxt is not None and not nxt.done():
                    nxt.cancel()
                elif nxt is not None and not nxt.cancelled():
                    nxt.exception()  # the stream's end, read as the call was cancelled: nothing to report

        return grpc.stream_stream_rpc_method_handler(steps, request_deserializer=unary.request_deserializer,
                                                     response_serializer=unary.response_serializer)

    def _accounted(self, full_method: str, method: str):
        metrics = self.metrics

        @contextlib.asynccontextmanager
        async def accounted(context):
            """Around one call: an exception becomes its status (never its text, unless it is
            ours), and the call's latency is recorded under the status it ended with."""
            t0, code = time.perf_counter(), "OK"
            try:
                yield
            except grpc.aio.AbortError:
                code = "ABORTED_BY_HANDLER"
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:  # noqa: BLE001 - the one place that turns errors into statuses
                status, message = status_for(exc)
                code = status.name
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", full_method)
                await context.abort(status, message)
            finally:
                if metrics is not None:
                    metrics.request_latency.labels(method=method, code=code).observe(time.perf_counter() - t0)

        return accounted


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (tests)
    metrics_port: Optional[int] = None  # None: no metrics endpoint; 0: any free port
    grace_period: float = 5.0  # seconds in-flight calls get after SIGTERM
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Servers close connections after this long so clients re-resolve (Kubernetes DNS load balancing).
    max_connection_age_s: Optional[float] = None
    tls: Optional[ServerTLS] = None  # None: plaintext, refused off loopback unless `insecure`
    insecure: bool = False  # plaintext on a non-loopback address is meant (a trusted network)
    token_file: Optional[str] = None  # accepted bearer token hashes (security.py); None: no tokens asked
    reflection: bool = True
    # A plaintext port serving only grpc.health.v1 (kubelet gRPC probes speak no TLS); None: none.
    health_port: Optional[int] = None


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect quickly to a replica that restarted (gRPC's default backoff grows to 120 s),
            # so a draft that comes back is drafting again within about a second.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]


# Servers let clients ping during calls as often as every second: a coordinator finds a link that
# went dead under a long call by its keepalive pings (clients.py) instead of waiting out a deadline.
KEEPALIVE_SERVER_OPTIONS = [("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                            ("grpc.http2.max_ping_strikes", 0)]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    metrics: ServiceMetrics
    metrics_port: Optional[int] = None
    _metrics_http: Optional[object] = None
    health_server: Optional[grpc.aio.Server] = None
    health_port: Optional[int] = None
    on_stop: list[Callable[[], object]] = field(default_factory=list)
    interceptor: Optional[ErrorInterceptor] = None
    stop_grace: float = 0.0  # the grace period of the stop in progress (for other servers stopped with this one)
    _stopped: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        if self._stopped:  # shutting down: stays NOT_SERVING whatever a dependency does
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: Optional[float] = 0.0) -> None:
        """Health goes NOT_SERVING, new calls are refused, in-flight calls get `grace` seconds."""
        if self._stopped:
            return
        self._stopped = True
        self.stop_grace = grace if grace is not None else 30.0
        await self.health.enter_graceful_shutdown()
        if self.interceptor is not None:
            self.interceptor.draining.set()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        for fn in self.on_stop:
            res = fn()
            if asyncio.iscoroutine(res):
                await res
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(settings: ServerSettings, add_servicers: Callable[[grpc.aio.Server], None],
                       service_names: Sequence[str], metrics: ServiceMetrics) -> RunningServer:
    """Start a grpc.aio server with health, reflection, the error interceptor and /metrics."""
    check_plaintext_allowed(settings.host, settings.tls, settings.insecure)
    options = channel_options(settings.max_message_bytes) + KEEPALIVE_SERVER_OPTIONS
    if settings.max_connection_age_s:
        options.append(("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)))
    # Tokens are checked first: a refused call never reaches the handler (nor its metrics).
    interceptors = [TokenAuthInterceptor(TokenFile(settings.token_file))] if settings.token_file else []
    errors = ErrorInterceptor(metrics)
    server = grpc.aio.server(interceptors=[*interceptors, errors], options=options)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection:
        reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    port = (server.add_secure_port(address, settings.tls.credentials()) if settings.tls
            else server.add_insecure_port(address))
    if port == 0:
        raise Unavailable(f"cannot listen on {settings.host}:{settings.port}")
    await server.start()
    running = RunningServer(server, port, health_servicer, tuple(service_names), metrics, interceptor=errors)
    if settings.health_port is not None:
        running.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, running.health_server)
        running.health_port = running.health_server.add_insecure_port(f"{settings.host}:{settings.health_port}")
        await running.health_server.start()
    if settings.metrics_port is not None:
        httpd, _ = metrics.serve_http(settings.host, settings.metrics_port)
        running._metrics_http = httpd
        running.metrics_port = httpd.server_port
    await running.set_serving(True)
    return running


async def serve_until_signal(running: RunningServer, grace_period: float) -> None:
    """Block until SIGTERM / SIGINT, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(running.wait())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received: NOT_SERVING, draining for %.1f s", grace_period)
        await running.stop(grace_period)
    waiter.cancel()
    stopper.cancel()


# --- settings: flags and a TOML file -----------------------------------------------------------

def parse_settings(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse flags, taking defaults from `--config FILE` (TOML, keys = flag names with underscores).

    Flags given on the command line override the file; an unknown key in the file is an error."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            with open(known.config, "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            parser.error(f"cannot read --config {known.config}: {exc}")
        dests = {a.dest for a in parser._actions}
        unknown = sorted(set(values) - dests)
        if unknown:
            parser.error(f"unknown settings in {known.config}: {', '.join(unknown)}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def add_common_flags(parser: argparse.ArgumentParser, port: int, metrics_port: int) -> None:
    parser.add_argument("--config", default=None, help="TOML file of settings (keys = flag names with underscores)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port})")
    parser.add_argument("--metrics-port", type=int, default=metrics_port,
                        help=f"Prometheus /metrics port (default {metrics_port}; -1 disables it)")
    parser.add_argument("--grace-period", type=float, default=5.0,
                        help="seconds in-flight calls get after SIGTERM (default 5)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for this process (default 0: torch's default, one per core)")
    add_tls_flags(parser)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("transport security")
    g.add_argument("--tls-cert", default=None, help="this service's TLS certificate chain (PEM); with --tls-key")
    g.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    g.add_argument("--tls-client-ca", default=None,
                   help="mutual TLS: refuse peers without a client certificate signed by this CA (PEM)")
    g.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback --host (default: refused without --tls-cert)")
    g.add_argument("--health-port", type=int, default=None,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (Kubernetes gRPC probes "
                        "cannot speak TLS); default: none")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Where and how the draft and target services hold their model."""
    parser.add_argument("--device", default="auto",
                        help="auto (default: the first CUDA GPU if one is visible, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (default: float32 on cpu, bfloat16 on a GPU), "
                        "float32, bfloat16, float16")
    parser.add_argument("--backend", default="auto", choices=["auto", "hf", "fast", "llamacpp"],
                        help="how the model runs: hf (transformers, any model), fast (specdec's Llama forward, same "
                             "outputs, faster on CPU), llamacpp (the target's GGUF file on llama.cpp: causal chains "
                             "only, so no Lookahead and Medusa as a chain; sessions side by side, a context each; "
                             "the draft service keeps a torch draft), auto (default: fast for Llama-family float32 "
                             "models on CPU)")


def add_session_flags(parser: argparse.ArgumentParser, max_sessions: int, batch_window_ms: float) -> None:
    """How many sessions the draft and target services keep, and how they batch their calls."""
    parser.add_argument("--max-sessions", type=int, default=max_sessions,
                        help="sessions whose KV cache is kept (least recently used go first)")
    parser.add_argument("--max-batch", type=int, default=8, help="sessions per batched model call")
    parser.add_argument("--batch-window-ms", type=float, default=batch_window_ms,
                        help="how long a call waits for others to join its batch")
    parser.add_argument("--max-k", type=int, default=32, help="most tokens per Propose or Verify block")


def model_placement(args: argparse.Namespace) -> tuple[str, "torch.dtype"]:  # noqa: F821
    """(device, dtype) from --device / --dtype, checked (ModelLoadError names what is wrong)."""
    from specdec.models import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    return device, resolve_dtype(args.dtype, device)


def run_service(name: str, serve: Callable[[argparse.Namespace], "asyncio.Future"], args: argparse.Namespace,
                errors: tuple[type[BaseException], ...] = (SpecdecError,)) -> int:
    """A service's main: logging, the event loop, and a one-line error with exit status 2 for a
    bad setting or model (never a traceback)."""
    import sys

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        s = server_settings(args)  # a bad TLS setting or plaintext off loopback: refused before loading a model
        check_plaintext_allowed(s.host, s.tls, s.insecure)
        asyncio.run(serve(args))
    except errors as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def apply_threads(args: argparse.Namespace) -> None:
    """Several model processes on one machine each default to a thread per core and then fight
    over the cores; --threads caps this process."""
    if getattr(args, "threads", 0) and args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(host=args.host, port=args.port,
                          metrics_port=None if args.metrics_port is not None and args.metrics_port < 0
                          else args.metrics_port,
                          grace_period=args.grace_period, max_message_bytes=args.max_message_bytes,
                          tls=server_tls(args), insecure=args.insecure, health_port=args.health_port,
                          token_file=getattr(args, "token_file", None), reflection=getattr(args, "reflection", True))


def server_tls(args: argparse.Namespace) -> Optional[ServerTLS]:
    if not args.tls_cert and not args.tls_key:
        if args.tls_client_ca:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise SecurityConfigError("TLS needs both --tls-cert and --tls-key")
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
