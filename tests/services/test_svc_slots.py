"""Session slots through the services (real redis-server): more sessions than the target has
slots for wait their turn in the coordinator; the target never holds more at once; all finish
with plain decoding's output."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from specdec.decode import plain_generate
from specdec.types import StopConditions
from tests.services.stack import FAST, local_stack, run, slow


def test_sessions_beyond_the_targets_slots_wait_and_all_finish_as_plain_decoding(redis_url, long_target):
    prompts = [[(5 * i + j) % 90 + 3 for j in range(6)] for i in range(6)]

    async def scenario():
        async with local_stack(redis_url, slow(long_target, 3.0), settings=replace(FAST, sessions_per_target=2)) as st:
            target = st.targets[0].core
            held, waiting, done = [], [], False

            async def watch():
                while not done:
                    held.append(len(target.sessions))
                    waiting.append(st.core.slots.waiting)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            outs = await asyncio.gather(*(st.client.generate(st.client.request(token_ids=p, max_tokens=12,
                                                                                method="plain"))
                                          for p in prompts))
            done = True
            await watcher
            return outs, max(held), max(waiting), st.core.slots.waiting, st.core.slots.active

    outs, most_held, most_waiting, waiting_after, active_after = run(scenario())
    assert most_held <= 2, f"the target held {most_held} sessions at once with 2 slots"
    assert most_waiting >= 3, "no session waited for a slot: the test shows nothing"
    assert waiting_after == 0 and active_after == 0
    stop = StopConditions(max_new_tokens=12)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == list(plain_generate(long_target, [prompt], stop=stop)[0].token_ids)
