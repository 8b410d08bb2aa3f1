"""The coordinator's session slots: at most per_replica x live replicas sessions generate at once,
the others wait in arrival order; a waiter that is cancelled leaves nothing behind."""

import asyncio

from coordinator.slots import SessionSlots


def test_sessions_beyond_the_slots_wait_their_turn_in_arrival_order():
    async def scenario():
        replicas = [1]
        waiting_seen = []
        slots = SessionSlots(2, lambda: replicas[0], on_change=waiting_seen.append)
        order, peak, release = [], [0], asyncio.Event()

        async def session(i):
            async with slots.hold():
                order.append(i)
                peak[0] = max(peak[0], slots.active)
                await release.wait()

        tasks = [asyncio.create_task(session(i)) for i in range(6)]
        await asyncio.sleep(0.01)
        first = list(order)
        queued = slots.waiting
        replicas[0] = 2  # a replica joined: two more slots
        slots.wake()
        await asyncio.sleep(0.01)
        grown = list(order)
        release.set()
        await asyncio.gather(*tasks)
        return first, queued, grown, order, peak[0], slots.active, slots.waiting, waiting_seen[-1]

    first, queued, grown, order, peak, active, waiting, told = asyncio.run(scenario())
    assert first == [0, 1] and queued == 4
    assert grown == [0, 1, 2, 3]
    assert order == list(range(6)) and peak == 4
    assert active == 0 and waiting == 0 and told == 0


def test_a_waiting_session_that_is_cancelled_gives_its_place_up():
    async def scenario():
        slots = SessionSlots(1, lambda: 1)
        gate = asyncio.Event()
        got = []

        async def session(i):
            async with slots.hold():
                got.append(i)
                await gate.wait()

        holder = asyncio.create_task(session(0))
        await asyncio.sleep(0.01)
        cancelled = asyncio.create_task(session(1))
        later = asyncio.create_task(session(2))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(holder, later)
        return got, slots.active, slots.waiting, cancelled.cancelled()

    got, active, waiting, was_cancelled = asyncio.run(scenario())
    assert was_cancelled and got == [0, 2] and active == 0 and waiting == 0
