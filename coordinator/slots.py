"""Session slots: at most `per_replica` sessions generate at once per live target replica; the
others wait their turn here, in arrival order (llama-server's slots, vLLM's waiting queue).

Without them, every session that arrives starts at once: on a CPU target, 64 arrivals queue 64
prefills on its one model thread, so each admitted session's next token waits behind every
prompt that came after it (measured, `specdec/bench/load.py --real --streams 64`: inter-token p99 3.9 s,
time to first token 75 s, a call past its 60 s deadline taking the only target out of the ring),
and every session holds a llama.cpp context (~94 MB of KV for 4,096 tokens) at once. A session
that waits holds nothing on the target, and a stream sees its first token when it gets a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import AsyncIterator, Callable, Optional


class SessionSlots:
    def __init__(self, per_replica: int, replicas: Callable[[], int],
                 on_change: Optional[Callable[[int], None]] = None):
        """replicas(): the live target replicas now (at least one set of slots is kept when none is);
        on_change(waiting): told whenever the number of waiting sessions may have changed."""
        if per_replica < 1:
            raise ValueError(f"per_replica must be >= 1, got {per_replica}")
        self.per_replica, self.replicas, self.on_change = per_replica, replicas, on_change
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def capacity(self) -> int:
        return self.per_replica * max(1, self.replicas())

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """A slot for the body: at once when one is free and nobody waits, else in arrival order."""
        if self._waiters or self.active >= self.capacity:
            turn = asyncio.get_running_loop().create_future()
            self._waiters.append(turn)
            self._told()
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # given a slot as it was cancelled: hand it on
                    self._release()
                else:
                    self._waiters.remove(turn)
                    self._told()
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.active -= 1
        self.wake()

    def wake(self) -> None:
        """Give free slots to the first waiters (also when replicas joined)."""
        while self._waiters and self.active < self.capacity:
            turn = self._waiters.popleft()
            if not turn.done():
                self.active += 1
                turn.set_result(None)
        self._told()

    def _told(self) -> None:
        if self.on_change is not None:
            self.on_change(self.waiting)
