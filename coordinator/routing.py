"""Session-affine routing: consistent hashing of session ids over the live replicas of a service.

A session's Propose and Verify calls go to the same draft and target replica while it lives, so
its KV cache stays warm; when the replica set changes, only the sessions whose arc of the ring
changed move (and rebuild their caches from Redis). Replicas come from flags / a file, or from
the Kubernetes API (EndpointSlices of the service, see discovery.py). A replica that fails a
call or a health check leaves the ring until it answers SERVING again after a cool-down: for
the draft this is the circuit breaker that sends sessions to target-side fallback.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, Optional, Sequence, TypeVar

log = logging.getLogger("coordinator.routing")
C = TypeVar("C")


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: pick(key) -> member."""

    def __init__(self, members: Iterable[str], vnodes: int = 64):
        self.members = tuple(sorted(set(members)))
        points = sorted((_hash(f"{m}#{i}"), m) for m in self.members for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [m for _, m in points]

    def pick(self, key: str) -> Optional[str]:
        if not self._keys:
            return None
        i = bisect.bisect(self._keys, _hash(key)) % len(self._keys)
        return self._owners[i]


@dataclass
class Replica(Generic[C]):
    address: str
    client: C
    healthy: bool = True
    open_until: float = 0.0  # breaker: not used before this time after a failure
    usable: bool = True  # False: permanently refused (e.g. a draft with another vocabulary)
    checked: bool = False  # its model facts were checked against the target's
    model: str = ""  # the model it serves (its Info's name), once checked
    seen_serving: bool = False  # answered SERVING once: before that, failing a probe means "still starting"


@dataclass
class ReplicaPool(Generic[C]):
    """The replicas of one service, their health, and the ring over the live ones."""

    name: str
    make_client: Callable[[str], C]
    health_service: str = ""
    cooldown_s: float = 1.0  # after a failure, a replica stays out at least this long
    probe_interval_s: float = 0.5
    replicas: dict[str, Replica[C]] = field(default_factory=dict)
    _ring: Optional[HashRing] = None
    _ring_members: frozenset = frozenset()
    _monitor: Optional[asyncio.Task] = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    on_probe: Optional[Callable[[int], None]] = None  # told the live replicas' count after each probe (metrics)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Replace the replica set (from flags, a file or discovery); clients of kept replicas are reused."""
        new = [a.strip() for a in addresses if a.strip()]
        for addr in list(self.replicas):
            if addr not in new:
                rep = self.replicas.pop(addr)
                asyncio.ensure_future(rep.client.close())
                log.info("%s replica %s left", self.name, addr)
        for addr in new:
            if addr not in self.replicas:
                self.replicas[addr] = Replica(addr, self.make_client(addr))
                log.info("%s replica %s joined", self.name, addr)
        self._signal()

    def _signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def live(self) -> list[str]:
        now = time.monotonic()
        return [a for a, r in self.replicas.items() if r.usable and r.healthy and now >= r.open_until]

    def pick(self, session_id: str, prefer: Optional[str] = None) -> Optional[Replica[C]]:
        """The replica for this session: `prefer` while it is live (a session's home, chosen by
        prefix affinity), else the ring's choice."""
        if prefer is not None and prefer in self.live():
            return self.replicas[prefer]
        members = frozenset(self.live())
        if members != self._ring_members or self._ring is None:
            self._ring, self._ring_members = HashRing(members), members
        addr = self._ring.pick(session_id)
        return self.replicas.get(addr) if addr else None

    def mark_failed(self, address: str, reason: str = "") -> None:
        rep = self.replicas.get(address)
        if rep is not None and rep.healthy:
            log.warning("%s replica %s out of the ring: %s", self.name, address, reason)
        if rep is not None:
            rep.healthy = False
            rep.open_until = time.monotonic() + self.cooldown_s

    def mark_unusable(self, address: str, reason: str) -> None:
        rep = self.replicas.get(address)
        if rep is not None and rep.usable:
            log.error("%s replica %s refused: %s", self.name, address, reason)
            rep.usable = False

    async def probe_once(self) -> None:
        async def probe(rep: Replica[C]) -> None:
            ok = await rep.client.healthy(self.health_service)
            if not ok and not rep.seen_serving:
                if rep.healthy:  # still loading its model: out of the ring, but nothing went wrong
                    log.info("%s replica %s is not serving yet", self.name, rep.address)
                    rep.healthy = False
                return
            rep.seen_serving = rep.seen_serving or ok
            if ok and not rep.healthy and time.monotonic() >= rep.open_until:
                log.info("%s replica %s is back in the ring", self.name, rep.address)
                rep.healthy = True
                self._signal()
            elif not ok and rep.healthy:
                self.mark_failed(rep.address, "health check failed")

        await asyncio.gather(*(probe(r) for r in list(self.replicas.values())), return_exceptions=True)

    async def wait_for_live(self, timeout: float) -> bool:
        """Wait until some replica is live (probing it), up to timeout seconds."""
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                while True:
                    await self.probe_once()
                    if self.live():
                        break
                    await asyncio.sleep(self.probe_interval_s)
        except TimeoutError:
            pass
        return bool(self.live())

    def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._run_monitor())

    async def _run_monitor(self) -> None:
        while True:
            await self.probe_once()
            if self.on_probe is not None:
                self.on_probe(len(self.live()))
            await asyncio.sleep(self.probe_interval_s)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                await self._monitor
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*(r.client.close() for r in self.replicas.values()), return_exceptions=True)
