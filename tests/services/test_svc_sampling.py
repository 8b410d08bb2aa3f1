"""Sampling through the services: seeded outputs do not depend on batch neighbours."""

from __future__ import annotations

import asyncio

from specdec.types import SamplingParams
from tests.services.stack import local_stack, run

SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=1234)


def test_a_seeded_request_gives_the_same_text_alone_and_among_seven_concurrent_sessions(redis_url, long_target,
                                                                                      weak_draft):
    prompt = [5, 6, 7, 8, 9]
    # Same sampling settings (so the draft service drafts them in one batch group), other prompts
    # of other lengths (so their positions differ from ours).
    others = [[10 + i] * (2 + i) for i in range(7)]

    async def scenario():
        async with local_stack(redis_url, long_target, weak_draft) as st:
            def request(p):
                return st.client.request(token_ids=p, max_tokens=30, sampling=SEEDED, k=4)

            alone = await st.client.generate(request(prompt))
            *_, among = await asyncio.gather(*(st.client.generate(request(p)) for p in [*others, prompt]))
            batch = st.drafts[0].core.metrics.batch_size.collect()[0].samples
            return alone, among, batch

    alone, among, batch = run(scenario())
    sizes = {s.name.rsplit("_", 1)[-1]: s.value for s in batch if s.name.endswith(("_sum", "_count"))}
    assert sizes["sum"] / sizes["count"] > 1.5, "the draft service never batched the sessions"
    assert alone.stats["drafted"] > 0 and len(alone.token_ids) == 30
    assert among.token_ids == alone.token_ids
