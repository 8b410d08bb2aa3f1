"""Transport security and client authentication, written once for the three services.

- TLS on a server port: a certificate and key (PEM files). With a client CA as well, the port
  wants mutual TLS: a peer without a certificate signed by that CA fails the handshake (the
  draft and target services, which only the coordinator calls).
- TLS on a channel: the CA that signed the server's certificate, optionally a client certificate
  (the coordinator's, for mutual TLS) and the name to check the server's certificate against
  when the address is an IP (Kubernetes pod addresses come from EndpointSlices).
- Plaintext is for loopback: a server told to listen elsewhere without TLS refuses to start
  unless `insecure` says plaintext is meant (e.g. inside a cluster whose network is trusted).
- Bearer tokens (coordinator): a file of accepted token hashes, one sha256 hex digest a line
  (`#` comments), re-read when it changes, so a token is added or revoked by editing the file.
  A call without a token whose hash is listed ends UNAUTHENTICATED before its handler runs;
  grpc.health.v1 is exempt (probes and load balancers carry no token).

Known limitations: certificates are read at start (rotating them means restarting the pod, which
a rolling update does); a revoked token stops new calls at once, not a stream already running.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from specdec.errors import SpecdecError

log = logging.getLogger("specdec.rpc.security")

AUTH_HEADER = "authorization"  # gRPC metadata keys are lower case
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED = "missing or invalid bearer token"


class SecurityConfigError(SpecdecError):
    """A TLS or token setting that cannot work (a missing file, plaintext on a public address)."""


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerTLS:
    cert: str  # this server's certificate chain (PEM)
    key: str  # its private key (PEM)
    client_ca: Optional[str] = None  # require client certificates signed by this CA (mutual TLS)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        ca = _read(self.client_ca, "client CA")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    ca: Optional[str] = None  # the CA that signed the server's certificate (None: the system's roots)
    cert: Optional[str] = None  # a client certificate to present (mutual TLS)
    key: Optional[str] = None
    server_name: Optional[str] = None  # check the server's certificate against this name, not the address

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("a client certificate needs both its certificate and key files")
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA certificate"),
                                            private_key=_read(self.key, "TLS key"),
                                            certificate_chain=_read(self.cert, "TLS certificate"))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def secure_channel(address: str, options: list, tls: Optional[ClientTLS]) -> grpc.aio.Channel:
    """A plaintext channel without `tls`, else a TLS one (mutual when it holds a client certificate)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.options())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_allowed(host: str, tls: Optional[ServerTLS], insecure: bool) -> None:
    if tls is None and not insecure and not is_loopback(host):
        raise SecurityConfigError(
            f"refusing to serve plaintext on {host}: give --tls-cert and --tls-key, listen on 127.0.0.1, "
            f"or pass --insecure if this network is trusted")


# --- bearer tokens -----------------------------------------------------------------------------

def token_hash(token: str) -> str:
    """What the token file lists for a token: its sha256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenFile:
    """The accepted token hashes, re-read whenever the file changes (checked at most every
    `recheck_s` seconds). A file that cannot be read or parsed accepts nothing (fail closed)."""

    def __init__(self, path: str, recheck_s: float = 0.0, clock=None):
        self.path = path
        self.recheck_s = recheck_s
        self._clock = clock or time.monotonic
        self._stamp: Optional[tuple] = None
        self._checked = float("-inf")
        self._hashes: frozenset[str] = frozenset()
        self._load()
        if not self._hashes:
            raise SecurityConfigError(f"the token file {path} lists no sha256 token hashes")

    def _load(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            if self._hashes:
                log.error("token file %s unreadable (%s): refusing every token until it is back", self.path, exc)
            self._hashes, self._stamp = frozenset(), None
            return
        hashes = set()
        for n, line in enumerate(lines, 1):
            word = line.split("#", 1)[0].strip().lower().removeprefix("sha256:")
            if not word:
                continue
            if len(word) != 64 or any(c not in "0123456789abcdef" for c in word):
                log.error("token file %s line %d is not a sha256 hex digest: ignored", self.path, n)
                continue
            hashes.add(word)
        self._hashes, self._stamp = frozenset(hashes), stamp
        log.info("token file %s: %d accepted token hashes", self.path, len(hashes))

    def accepts(self, token: Optional[str]) -> bool:
        now = self._clock()
        if now - self._checked >= self.recheck_s:
            self._checked = now
            self._load()
        # Comparing hashes: how long the lookup takes says nothing about the token itself.
        return bool(token) and token_hash(token) in self._hashes


def bearer_token(metadata) -> Optional[str]:
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without an accepted bearer token, before its handler runs."""

    def __init__(self, tokens: TokenFile):
        self.tokens = tokens

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)  # a lookup only: nothing of the handler runs yet
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        if self.tokens.accepts(bearer_token(details.invocation_metadata)):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)


def read_token(path: Optional[str] = None, env: str = "SPECDEC_TOKEN") -> Optional[str]:
    """A client's bearer token: the first line of `path`, else the environment variable `env`."""
    if path:
        data = _read(path, "token file")
        token = data.decode("utf-8", "replace").strip().splitlines()[0].strip() if data.strip() else ""
        if not token:
            raise SecurityConfigError(f"the token file {path} is empty")
        return token
    return os.environ.get(env) or None
