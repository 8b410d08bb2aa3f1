"""Sessions in a real Redis: versioned compare-and-set writes, TTL, strict ids."""

from __future__ import annotations

import uuid

import pytest

from coordinator.records import SessionRecord
from coordinator.sessions import SessionStore, pack_tokens, unpack_tokens
from specdec.errors import InvalidRequest
from specdec.errors import Aborted, NotFound, Unavailable
from tests.services.stack import run


def _record() -> SessionRecord:
    return SessionRecord(session_id=uuid.uuid4().hex, prompt_len=3, tokens=[5, 6, 7], params={"k": 4})


def test_tokens_pack_and_unpack_as_int32():
    ids = [0, 1, 49151, 2**31 - 1]
    assert unpack_tokens(pack_tokens(ids)) == ids


def test_create_then_commit_appends_tokens_and_bumps_the_version(redis_url):
    async def scenario():
        store = SessionStore(redis_url, ttl_s=60)
        rec = _record()
        try:
            assert await store.create(rec)
            assert not await store.create(rec), "an existing id must not be overwritten"
            await store.commit(rec, [8, 9], "running")
            await store.commit(rec, [10], "done", "length", {"emitted": 3})
            loaded = await store.load(rec.session_id)
            ttl = await store.redis.ttl(store.key(rec.session_id))
            return rec, loaded, ttl
        finally:
            await store.close()

    rec, loaded, ttl = run(scenario())
    assert loaded.tokens == [5, 6, 7, 8, 9, 10] == rec.tokens
    assert loaded.generated == [8, 9, 10] and loaded.version == 2
    assert (loaded.status, loaded.finish_reason, loaded.stats) == ("done", "length", {"emitted": 3})
    assert 0 < ttl <= 60


def test_a_stale_writer_is_refused_and_applies_nothing(redis_url):
    async def scenario():
        store = SessionStore(redis_url, ttl_s=60)
        try:
            rec = _record()
            await store.create(rec)
            other = await store.load(rec.session_id)
            await store.commit(other, [8], "running")  # another coordinator wrote first
            with pytest.raises(Aborted):
                await store.commit(rec, [99], "running")
            return await store.load(rec.session_id)
        finally:
            await store.close()

    assert run(scenario()).tokens == [5, 6, 7, 8]


def test_a_retried_write_that_already_applied_is_not_applied_twice(redis_url):
    async def scenario():
        store = SessionStore(redis_url, ttl_s=60)
        try:
            rec = _record()
            await store.create(rec)
            ghost = SessionRecord(**{**rec.__dict__, "tokens": list(rec.tokens)})
            await store.commit(ghost, [8, 9], "running")  # the first attempt reached Redis, its reply was lost
            await store.commit(rec, [8, 9], "running")  # the retry
            return rec, await store.load(rec.session_id)
        finally:
            await store.close()

    rec, loaded = run(scenario())
    assert loaded.tokens == [5, 6, 7, 8, 9] == rec.tokens and loaded.version == 1 == rec.version


def test_unknown_and_malformed_sessions(redis_url):
    async def scenario():
        store = SessionStore(redis_url)
        try:
            with pytest.raises(NotFound):
                await store.load("no-such-session")
            with pytest.raises(InvalidRequest):
                await store.load("bad id with spaces")
        finally:
            await store.close()

    run(scenario())


def test_a_down_redis_is_unavailable(redis_server):
    from specdec.app.launcher import RedisServer

    async def scenario(url):
        store = SessionStore(url)
        try:
            with pytest.raises(Unavailable):
                await store.load("some-session-id")
        finally:
            await store.close()

    dead = RedisServer().start()
    url = dead.url
    dead.kill()
    run(scenario(url))
