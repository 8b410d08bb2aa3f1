"""Sessions in Redis (redis-py asyncio): what a cold coordinator or replica needs to continue.

One hash per session, `specdec:session:{id}`: committed token ids (prompt + generated, packed
little-endian int32), prompt length, the request's settings (sampling and seed, stop
conditions, method, k), status (running | paused | done), finish reason, counters, a version
number, and a TTL refreshed on every write. Every write is a compare-and-set on the version,
in one Lua script, so two coordinators (or a retried write) can never apply tokens twice or
interleave them; tokens are committed here *before* they are streamed to a client.
"""

from __future__ import annotations

import json
import time
from array import array
from typing import Optional, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from specdec.errors import Aborted, NotFound, Unavailable
from specdec.sessions import check_session_id
from coordinator.records import STORE_DOWN, SessionRecord

KEY_PREFIX = "specdec:session:"
# What a client sees while Redis is unreachable: ours, never the driver's exception.

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# ARGV: expected version, ttl, tokens to append, status, finish_reason, stats json
_COMMIT = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return -2 end
if v ~= ARGV[1] then return -1 end
local toks = redis.call('HGET', KEYS[1], 'tokens') or ''
local nv = tonumber(v) + 1
redis.call('HSET', KEYS[1], 'tokens', toks .. ARGV[3], 'version', tostring(nv), 'status', ARGV[4],
           'finish_reason', ARGV[5], 'stats', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return nv
"""


def pack_tokens(ids: Sequence[int]) -> bytes:
    return array("i", (int(t) for t in ids)).tobytes()  # native int32; checked little-endian below


def unpack_tokens(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


assert array("i").itemsize == 4 and int.from_bytes(array("i", [1]).tobytes(), "little") == 1


class SessionStore:
    def __init__(self, url: str, ttl_s: int = 3600, client: Optional[aioredis.Redis] = None, **options):
        """`url`: redis://[USER:PASSWORD@]HOST:PORT/DB, or rediss:// for TLS; `options`: redis-py
        connection settings that override it (username, password, ssl_ca_certs, ssl_certfile, ...)."""
        self.url = url
        self.ttl_s = int(ttl_s)
        # Short timeouts: a down Redis must surface as UNAVAILABLE quickly, not after the defaults.
        # One reconnect on a broken pooled connection (Redis restarted since it was opened): the
        # first request after a restart must not fail on a socket the old server closed. A commit
        # retried after it ran is refused by its version check, never applied twice.
        options = {"retry": Retry(NoBackoff(), 1), "retry_on_error": [RedisConnectionError], **options}
        self.redis = client or aioredis.from_url(url, socket_timeout=5, socket_connect_timeout=2, **options)
        self._create = self.redis.register_script(_CREATE)
        self._commit = self.redis.register_script(_COMMIT)

    @staticmethod
    def key(session_id: str) -> str:
        return KEY_PREFIX + check_session_id(session_id)

    async def _guard(self, coro):
        try:
            return await coro
        except RedisError:
            raise Unavailable(STORE_DOWN) from None

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except RedisError:
            return False

    async def create(self, rec: SessionRecord) -> bool:
        """Store a new session; False if the id is taken."""
        fields = {"prompt_len": rec.prompt_len, "tokens": pack_tokens(rec.tokens), "params": json.dumps(rec.params),
                  "status": rec.status, "finish_reason": rec.finish_reason, "version": "0",
                  "stats": json.dumps(rec.stats), "created": f"{time.time():.3f}"}
        args = [self.ttl_s]
        for k, v in fields.items():
            args += [k, v]
        created = await self._guard(self._create(keys=[self.key(rec.session_id)], args=args))
        rec.version = 0
        return bool(created)

    async def load(self, session_id: str) -> SessionRecord:
        raw = await self._guard(self.redis.hgetall(self.key(session_id)))
        if not raw:
            raise NotFound(f"unknown session {session_id}")
        get = lambda k: raw.get(k.encode(), b"")  # noqa: E731
        return SessionRecord(session_id=session_id, prompt_len=int(get("prompt_len")),
                             tokens=unpack_tokens(get("tokens")), params=json.loads(get("params") or b"{}"),
                             status=get("status").decode(), finish_reason=get("finish_reason").decode(),
                             version=int(get("version") or 0), stats=json.loads(get("stats") or b"{}"))

    async def commit(self, rec: SessionRecord, new_tokens: Sequence[int], status: str, finish_reason: str = "",
                     stats: Optional[dict] = None) -> None:
        """Append tokens and set status, only if nobody wrote since `rec.version`; updates rec."""
        stats = rec.stats if stats is None else stats
        args = [str(rec.version), self.ttl_s, pack_tokens(new_tokens), status, finish_reason, json.dumps(stats)]
        got = await self._guard(self._commit(keys=[self.key(rec.session_id)], args=args))
        if got == -2:
            raise NotFound(f"session {rec.session_id} expired or was deleted")
        if got == -1:
            # A retried write may have applied already: then Redis holds exactly what we meant to write.
            now = await self.load(rec.session_id)
            if now.version == rec.version + 1 and now.tokens == rec.tokens + list(new_tokens):
                got = now.version
            else:
                raise Aborted(f"session {rec.session_id} was continued elsewhere (version {now.version})")
        rec.version = int(got)
        rec.tokens.extend(int(t) for t in new_tokens)
        rec.status, rec.finish_reason, rec.stats = status, finish_reason, dict(stats)

    async def delete(self, session_id: str) -> None:
        await self._guard(self.redis.delete(self.key(session_id)))

    async def close(self) -> None:
        await self.redis.aclose()
