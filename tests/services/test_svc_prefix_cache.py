"""The target service's prefix cache through the services (draft-free, real redis-server): a
session that starts as an earlier one did (a shared system prompt or document, a conversation's
next turn) prefills only what follows the cached prefix, and its output is plain decoding's."""

from __future__ import annotations


import pytest

from target_service.core import TargetSettings
from tests.conftest import assert_greedy_equal, plain


def _counter(metric) -> float:
    return next(s.value for s in metric.collect()[0].samples if s.name.endswith("_total"))


@pytest.mark.parametrize("backend", ["torch", "llamacpp", "llamacpp-any"])
def test_the_prefix_cache_serves_shared_prompts_and_earlier_turns_and_output_stays_plain(
        redis_url, long_target, tmp_path, backend):
    """A second session with the same long prompt, and a second turn that starts with the first
    turn's tokens, prefill only what follows the cached prefix; the outputs equal plain decoding;
    the cache stays within its budget. On llama.cpp only whole prefill blocks of prompts are
    reused, unless --prefix-cache-any (lossy there) asks for all of it."""
    from tests.conftest import gguf_copy
    from tests.services.stack import local_stack, run

    lm = long_target if backend == "torch" else gguf_copy(long_target, tmp_path / "t.gguf", context=512, n_batch=16)
    reuse_any = backend == "llamacpp-any"
    whole = 1 if reuse_any else lm.prefill_block  # llama.cpp: whole prefill blocks of prompts (specdec.prefix_cache)
    system = [(5 * i + 7) % 90 + 3 for i in range(70)]  # a long shared start (a system prompt, a document)

    async def scenario():
        settings = TargetSettings(prefix_cache_mb=1, prefix_cache_any=reuse_any)
        async with local_stack(redis_url, lm, target_settings=settings) as st:
            core = st.targets[0].core
            first = await st.client.generate(st.client.request(token_ids=system + [11, 12], max_tokens=20,
                                                                method="plain"))
            # (no pause: the first session's KV is in the cache before its answer comes back)
            hits_before, queries_before = _counter(core.metrics.prefix_cache_hits), \
                _counter(core.metrics.prefix_cache_queries)
            second = await st.client.generate(st.client.request(token_ids=system + [13, 14, 15], max_tokens=20,
                                                                 method="plain"))
            shared = _counter(core.metrics.prefix_cache_hits) - hits_before
            queried = _counter(core.metrics.prefix_cache_queries) - queries_before
            # the prompt but its last token (its whole blocks on llama.cpp) was looked up, once
            assert queried == (len(system) + 3 - 1) // whole * whole
            turn2 = system + [11, 12] + list(first.token_ids) + [21, 22]
            third = await st.client.generate(st.client.request(token_ids=turn2, max_tokens=20, method="plain"))
            turn = _counter(core.metrics.prefix_cache_hits) - hits_before - shared
            return first, second, third, shared, turn, core.prefix_cache.bytes_held, turn2

    first, second, third, shared, turn, held, turn2 = run(scenario())
    for prompt, out in ((system + [11, 12], first), (system + [13, 14, 15], second), (turn2, third)):
        assert_greedy_equal(lm, prompt, out.token_ids, plain(lm, prompt, 20).token_ids)
    assert shared >= 64, "the second session did not reuse the shared start"
    if whole == 1:  # the first session's KV (its prompt and answer but the last token), in whole blocks of 16
        assert turn >= 16 * ((len(system) + 2 + 20 - 1) // 16), "the second turn did not reuse the first turn"
    else:  # its prompt's whole prefill blocks: a fresh prefill computes the decoded answer otherwise
        assert turn == (len(system) + 2) // whole * whole
    assert 0 < held <= 1 << 20


def test_a_conversations_next_turn_goes_to_the_target_replica_that_holds_its_first(redis_url, long_target):
    """Two target replicas: the second turn's session id hashes to the other replica, yet it runs
    where the first turn ran (prefix affinity) and reuses the first turn's KV there; a session
    with an unrelated prompt still follows the ring."""
    from coordinator.routing import HashRing
    from tests.services.stack import local_stack, run

    start = [(7 * i + 3) % 90 + 3 for i in range(50)]

    async def scenario():
        async with local_stack(redis_url, long_target, n_targets=2,
                               target_settings=TargetSettings(prefix_cache_mb=1)) as st:
            by_address = {t.address: t.core for t in st.targets}
            ring = HashRing(by_address)
            first = await st.client.generate(st.client.request(token_ids=start, max_tokens=20, method="plain",
                                                                session_id="turn-one-0001"))
            home = ring.pick("turn-one-0001")
            other = next(a for a in by_address if a != home)
            second_id = next(f"turn-two-{i:04d}" for i in range(1000) if ring.pick(f"turn-two-{i:04d}") == other)
            hits = {a: _counter(c.metrics.prefix_cache_hits) for a, c in by_address.items()}
            turn2 = start + list(first.token_ids) + [21, 22]
            second = await st.client.generate(st.client.request(token_ids=turn2, max_tokens=20, method="plain",
                                                                 session_id=second_id))
            gained = {a: _counter(c.metrics.prefix_cache_hits) - hits[a] for a, c in by_address.items()}
            prefills = {a: c.prefills.get(second_id, 0) for a, c in by_address.items()}
            unrelated_id = next(f"other-{i:04d}" for i in range(1000) if ring.pick(f"other-{i:04d}") == other)
            await st.client.generate(st.client.request(token_ids=[40, 41, 42, 43], max_tokens=4, method="plain",
                                                       session_id=unrelated_id))
            unrelated = {a: c.prefills.get(unrelated_id, 0) for a, c in by_address.items()}
            return home, other, second, turn2, gained, prefills, unrelated

    home, other, second, turn2, gained, prefills, unrelated = run(scenario())
    assert prefills[home] >= 1 and prefills[other] == 0, "the second turn did not go to the first turn's replica"
    assert gained[home] >= 16 * ((len(start) + 20 - 1) // 16), "the second turn did not reuse the first turn's KV"
    assert_greedy_equal(long_target, turn2, second.token_ids, plain(long_target, turn2, 20).token_ids)
    assert unrelated[other] >= 1 and unrelated[home] == 0, "an unrelated session left the ring's choice"
