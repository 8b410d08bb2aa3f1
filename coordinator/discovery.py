"""Where the replicas are: a static list (flags or a file), or the Kubernetes API.

In a cluster the coordinator watches the EndpointSlices of the draft and target Services (label
kubernetes.io/service-name=NAME) with the `kubernetes` client and keeps each ReplicaPool's set
to the ready endpoints. The client is synchronous, so the watch runs in a thread and hands
updates to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable, Optional

log = logging.getLogger("coordinator.discovery")


def parse_replicas(spec: str) -> list[str]:
    """'h:p,h:p' or '@FILE' (one host:port per line, # comments) -> ['h:p', ...]."""
    if spec.startswith("@"):
        lines = Path(spec[1:]).read_text().splitlines()
        items = [line.split("#", 1)[0].strip() for line in lines]
    else:
        items = [s.strip() for s in spec.split(",")]
    out = [s for s in items if s]
    for s in out:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"replica {s!r} is not host:port")
    return out


def ready_addresses(slices: Iterable, port_name: Optional[str] = None) -> list[str]:
    """Ready endpoint addresses 'ip:port' of EndpointSlice objects (kubernetes client models).

    The port is the slice's port named port_name (None: its first port). Endpoints whose
    conditions say not ready, or terminating, are left out."""
    out = set()
    for sl in slices:
        ports = [p for p in (sl.ports or []) if port_name is None or p.name == port_name]
        if not ports or ports[0].port is None:
            continue
        port = ports[0].port
        for ep in sl.endpoints or []:
            cond = ep.conditions
            if cond is not None and (cond.ready is False or cond.terminating is True):
                continue
            for addr in ep.addresses or []:
                out.add(f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}")
    return sorted(out)


class EndpointSliceWatcher:
    """Watch one Service's EndpointSlices; call on_change(addresses) on the event loop."""

    def __init__(self, namespace: str, service: str, on_change: Callable[[list[str]], None],
                 loop: asyncio.AbstractEventLoop, port_name: Optional[str] = "grpc"):
        self.namespace, self.service, self.on_change, self.loop = namespace, service, on_change, loop
        self.port_name = port_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{service}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self.service}"
        slices: dict[str, object] = {}
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: s for s in listed.items}
                self._emit(slices)
                w = watch.Watch()
                for event in w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                      resource_version=listed.metadata.resource_version, timeout_seconds=60):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        slices.pop(obj.metadata.name, None)
                    else:
                        slices[obj.metadata.name] = obj
                    self._emit(slices)
                    if self._stop.is_set():
                        w.stop()
                        break
            except Exception as exc:  # noqa: BLE001 - keep watching through API hiccups
                log.warning("watching EndpointSlices of %s failed (%s); retrying", self.service, exc)
                self._stop.wait(2.0)

    def _emit(self, slices: dict) -> None:
        addrs = ready_addresses(slices.values(), self.port_name)
        self.loop.call_soon_threadsafe(self.on_change, addrs)
