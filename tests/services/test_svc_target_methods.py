"""Target-side methods (Decode on the target service's core) when sessions share a batch."""

from __future__ import annotations

import asyncio

from specdec.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdec.sessions import token_digest
from specdec.types import SamplingParams
from target_service.core import Position, TargetCore, TargetSettings
from tests.services.stack import mean_batch_size, run

PROMPTS = ([5, 6, 7, 8, 9, 5, 6, 7], [30, 31, 32, 33, 30, 31])
# The pool filled from the Jacobi window alone: whatever it accepts comes from the window's
# feedback (observe), which is what batching must not lose.
WINDOW_ONLY = {"lookahead": lambda: LookaheadProposer(LookaheadConfig(pool_from_context=False))}
# A long batch window: the two sessions' steps always share one forward when run together.
BATCH_OF_TWO = TargetSettings(max_batch=2, batch_window_ms=500.0)


async def _decode(core: TargetCore, session_id: str, prompt: list[int], max_tokens: int = 48) -> dict:
    await core.prefill(session_id, prompt)
    pos = Position(len(prompt), (), token_digest(prompt))
    return await core.decode(session_id, pos, max_tokens, "lookahead", SamplingParams())


def test_lookahead_sessions_verified_together_reach_the_same_tau_as_each_alone(long_target):
    async def scenario():
        alone = []
        for i, p in enumerate(PROMPTS):
            core = TargetCore(long_target, BATCH_OF_TWO, methods=WINDOW_ONLY)
            try:
                alone.append(await _decode(core, f"alone-{i:04d}", p))
            finally:
                await core.close()
        core = TargetCore(long_target, BATCH_OF_TWO, methods=WINDOW_ONLY)
        try:
            together = await asyncio.gather(*(_decode(core, f"together-{i:04d}", p) for i, p in enumerate(PROMPTS)))
            batched = mean_batch_size(core.metrics)
        finally:
            await core.close()
        return alone, together, batched

    alone, together, batched = run(scenario())
    assert batched > 1.5, "the sessions' steps were not batched together"
    assert all(a["num_accepted"] > 0 for a in alone), "lookahead accepted nothing alone: the test shows nothing"
    for a, t in zip(alone, together):
        assert t["emitted"] == a["emitted"]
        assert (t["target_forwards"], t["num_drafted"], t["num_accepted"]) == \
            (a["target_forwards"], a["num_drafted"], a["num_accepted"])
