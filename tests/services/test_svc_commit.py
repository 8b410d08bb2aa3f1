"""The Redis write of step i runs while step i+1 is drafted and verified (commit_behind): a client
still sees only tokens already written, the written tokens are the plain-decoding ones, and a
write that fails ends the stream without showing what it did not write."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.sessions import SessionStore
from specdec.decode import plain_generate
from specdec.errors import NotFound
from specdec.types import StopConditions
from tests.services.stack import FAST, local_stack, run, slow

PROMPT = [3, 4, 10, 11, 12, 13, 14]


@pytest.mark.parametrize("commit_behind", [True, False])
def test_every_streamed_chunk_is_already_in_redis(redis_url, long_target, weak_draft, commit_behind):
    async def scenario():
        settings = replace(FAST, commit_behind=commit_behind)
        async with local_stack(redis_url, slow(long_target, 5.0), weak_draft, settings=settings) as st:
            store = SessionStore(redis_url)
            seen, stored_at_chunk = [], []
            try:
                async for ch in st.client.generate_stream(st.client.request(token_ids=PROMPT, max_tokens=30)):
                    seen += ch.token_ids
                    stored_at_chunk.append((len(seen), (await store.load(ch.session_id)).generated))
                final = await store.load(ch.session_id)
            finally:
                await store.close()
            return seen, stored_at_chunk, final

    seen, stored_at_chunk, final = run(scenario())
    for shown, stored in stored_at_chunk:
        assert stored[:shown] == seen[:shown] and len(stored) >= shown, "a token reached the client before Redis"
    plain = list(plain_generate(long_target, [PROMPT], stop=StopConditions(max_new_tokens=30))[0].token_ids)
    assert seen == plain and final.generated == plain and final.status == "done"


def test_a_failed_write_ends_the_stream_without_showing_unwritten_tokens(redis_url, long_target, weak_draft):
    async def scenario():
        async with local_stack(redis_url, slow(long_target, 5.0), weak_draft) as st:
            store = SessionStore(redis_url)
            seen, error = [], None
            try:
                async for ch in st.client.generate_stream(st.client.request(token_ids=PROMPT, max_tokens=200)):
                    seen += ch.token_ids
                    if len(seen) >= 6 and not error:
                        written = len((await store.load(ch.session_id)).generated)
                        await store.delete(ch.session_id)  # every later write fails (NOT_FOUND)
                        error = "deleted"
            except NotFound as exc:
                error = exc
            finally:
                await store.close()
            return seen, written, error

    seen, written, error = run(scenario())
    assert isinstance(error, NotFound), error
    assert len(seen) <= written < 200, "tokens were shown that Redis never held"
