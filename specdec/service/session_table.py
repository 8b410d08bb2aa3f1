"""The per-session state a draft or target service holds in memory (KV caches), written once.

An LRU-bounded table: the least recently used session is evicted past `max_sessions` (its
client gets NOT_FOUND on the next call and prefills again from the coordinator's Redis copy),
plus a count of sessions that called recently, which tells the micro-batcher how many requests
a batch can hope to collect.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Generic, Iterator, Optional, TypeVar

from specdec.errors import NotFound

log = logging.getLogger("specdec.rpc")
S = TypeVar("S")


class SessionTable(Generic[S]):
    def __init__(self, max_sessions: int, make: Callable[[str], S], gauge=None, recent_s: float = 2.0,
                 on_count: Optional[Callable[[int], None]] = None):
        self.max_sessions = max_sessions
        self._make = make
        self._gauge = gauge  # a Prometheus gauge set to the number of sessions held, or None
        self._on_count = on_count  # told the number of sessions held at every change (e.g. memory.IdleTrim)
        self.recent_s = recent_s
        self._sessions: OrderedDict[str, S] = OrderedDict()
        self._last_seen: dict[str, float] = {}

    def get(self, session_id: str, create: bool = False) -> S:
        """The session (now the most recently used), made when `create`; NotFound otherwise."""
        sess = self._sessions.get(session_id)
        if sess is None:
            if not create:
                raise NotFound(f"unknown session {session_id}: prefill it first")
            sess = self._sessions[session_id] = self._make(session_id)
            while len(self._sessions) > self.max_sessions:
                evicted, _ = self._sessions.popitem(last=False)
                self._last_seen.pop(evicted, None)
                log.info("evicted session %s (LRU)", evicted)
        self._sessions.move_to_end(session_id)
        self._last_seen[session_id] = time.monotonic()
        self._update_gauge()
        return sess

    def release(self, session_id: str) -> bool:
        """Forget a session; False when it was not held here."""
        self._last_seen.pop(session_id, None)
        found = self._sessions.pop(session_id, None) is not None
        self._update_gauge()
        return found

    def active_recently(self) -> int:
        """Sessions that called in the last `recent_s` seconds."""
        now = time.monotonic()
        for sid in [s for s, t in self._last_seen.items() if now - t > self.recent_s]:
            del self._last_seen[sid]
        return len(self._last_seen)

    def _update_gauge(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._sessions))
        if self._on_count is not None:
            self._on_count(len(self._sessions))

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)
