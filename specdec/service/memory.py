"""Freed heap memory back to the system once a service has gone idle.

glibc keeps what a process frees in its heap arenas for its next allocations, so a service's
RSS stays near its peak after a burst of sessions although it holds none of them. Measured
after 64 concurrent streams for 60 s through `specdec up` (bench/load.py --real): the draft
service stayed ~100 MB over its baseline with no session held, and malloc_trim gave 60 MB of it
back; the target 50 MB, beside the KV its prefix cache keeps by design.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from typing import Callable, Optional

log = logging.getLogger("specdec.rpc")


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl and macOS have none
    except (AttributeError, OSError):
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the heap's free memory back to the system (glibc's malloc_trim(0)) -> whether the C
    library has that call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class IdleTrim:
    """A SessionTable's on_count: once the table has held no session for delay_s, trim the heap
    (on the event loop, which is idle then); a session that comes first cancels it. Not on every
    release: a client sending one request after another empties the table between them, and a
    trim takes milliseconds."""

    def __init__(self, delay_s: float = 2.0, trim: Callable[[], object] = trim_heap):
        self.delay_s, self._trim = delay_s, trim
        self._pending: Optional[asyncio.TimerHandle] = None
        self.trims = 0

    def __call__(self, count: int) -> None:
        if count:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
            return
        if self._pending is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # (not called on an event loop: nothing to wait on)
                return
            self._pending = loop.call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        self._trim()
        self.trims += 1
