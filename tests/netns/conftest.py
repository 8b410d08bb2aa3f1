"""A multi-host test bed on one machine: Redis, the coordinator, a draft and a target each in a
network namespace of its own, with its own address, joined by veth pairs (real links, each with
its own kernel TCP stack on either side), so a link can be cut with `ip link set DEV down`.

    test process (root namespace) ── 10.N.0.0/24 ── coordinator ── 10.N.1.0/24 ── redis
                                                                ── 10.N.2.0/24 ── draft
                                                                ── 10.N.3.0/24 ── target

Needs root (CAP_NET_ADMIN: `ip netns add`, veth pairs); CI runs as root. Anywhere else these
tests fail saying so: they cannot pass without the namespaces, and must not pass silently.
Traffic goes only to addresses inside the namespaces made here; all of them are removed at the
end. draft and target speak mutual TLS with the coordinator (certificates for these addresses),
the coordinator asks for bearer tokens: the whole security stack crosses the links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specdec.testing import perturbed_copy, tiny_llama
from specdec.app.launcher import find_redis_server
from specdec.rpc.security import ClientTLS, token_hash
from tests.tlscerts import make_ca

ROLES = ("coord", "redis", "draft", "target")
PORTS = {"coord": 50051, "redis": 6379, "draft": 50061, "target": 50062}
SLOW_SERVICE = ("-m", "specdec.bench.slow_service")
TOKEN = "netns-test-token-5b1f"


def netns_model(seed: int = 0):
    """The target the namespaced target service loads (no EOS: generations run to max_tokens)."""
    return tiny_llama(seed=seed, vocab_size=96, num_layers=2, hidden_size=48, eos_token_id=None)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _require_root() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("tests/netns need root and iproute2: they create network namespaces and veth pairs "
                    "(ip netns add, ip link add type veth) to run each service on a host of its own; "
                    "they cannot run as an ordinary user. Run them as root (as CI does).", pytrace=False)


@dataclass
class NetBed:
    tag: str
    net: int  # the second octet of 10.N.x.y
    dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def addr(self, role: str) -> str:
        """The address of `role` on its link to the coordinator (the coordinator's own: towards the test)."""
        return {"coord": f"10.{self.net}.0.2", "redis": f"10.{self.net}.1.2", "draft": f"10.{self.net}.2.2",
                "target": f"10.{self.net}.3.2"}[role]

    def link(self, role: str) -> str:
        """The coordinator's end of its link to `role` (in the coordinator's namespace)."""
        return f"{self.tag}c{role[0]}"

    def set_link(self, role: str, up: bool) -> None:
        _ip("-n", self.ns("coord"), "link", "set", self.link(role), "up" if up else "down")

    @property
    def coordinator(self) -> str:
        return f"{self.addr('coord')}:{PORTS['coord']}"

    def client_tls(self) -> ClientTLS:
        return ClientTLS(ca=str(self.dir / "ca" / "ca.pem"))

    # --- making and removing the namespaces ---------------------------------------------------
    def create(self) -> None:
        for role in ROLES:
            _ip("netns", "add", self.ns(role))
            self.namespaces.append(self.ns(role))
            _ip("-n", self.ns(role), "link", "set", "lo", "up")
        # the test's own link to the coordinator: root namespace <-> coord
        root_dev, coord_dev = f"{self.tag}r0", f"{self.tag}c0"
        _ip("link", "add", root_dev, "type", "veth", "peer", "name", coord_dev, "netns", self.ns("coord"))
        _ip("addr", "add", f"10.{self.net}.0.1/24", "dev", root_dev)
        _ip("link", "set", root_dev, "up")
        _ip("-n", self.ns("coord"), "addr", "add", f"{self.addr('coord')}/24", "dev", coord_dev)
        _ip("-n", self.ns("coord"), "link", "set", coord_dev, "up")
        for i, role in enumerate(("redis", "draft", "target"), start=1):
            c_dev, r_dev = self.link(role), f"{self.tag}{role[0]}c"
            _ip("link", "add", c_dev, "netns", self.ns("coord"), "type", "veth", "peer", "name", r_dev,
                "netns", self.ns(role))
            _ip("-n", self.ns("coord"), "addr", "add", f"10.{self.net}.{i}.1/24", "dev", c_dev)
            _ip("-n", self.ns(role), "addr", "add", f"{self.addr(role)}/24", "dev", r_dev)
            _ip("-n", self.ns("coord"), "link", "set", c_dev, "up")
            _ip("-n", self.ns(role), "link", "set", r_dev, "up")

    def remove(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for ns in self.namespaces:  # deleting a namespace deletes its veth ends, and so their peers
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"{self.tag}r0", check=False)

    # --- the services -------------------------------------------------------------------------
    def start(self, role: str, argv: list[str]) -> None:
        log = open(self.dir / f"{role}.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.procs[role] = subprocess.Popen(["ip", "netns", "exec", self.ns(role), *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2])
        log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.dir.glob("*.log")))


def _free_net() -> int:
    """A 10.N.0.0/16 block no interface of this machine uses."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    for n in [200 + (os.getpid() + i) % 50 for i in range(50)]:
        if f"10.{n}." not in used:
            return n
    pytest.fail("no free 10.N.0.0/16 block for the test bed")


@pytest.fixture(scope="module")
def netbed(tmp_path_factory):
    """The four namespaces with redis-server, target, draft and coordinator running, SERVING."""
    _require_root()
    d = tmp_path_factory.mktemp("netbed")
    bed = NetBed(tag=f"sd{os.getpid() % 100000}", net=_free_net(), dir=d)
    try:
        bed.create()
        ca = make_ca(d, "ca")
        certs = {r: ca.issue(r, hosts=(bed.addr(r),)) for r in ("draft", "target")}
        coord_cert = ca.issue("coordinator", hosts=(bed.addr("coord"),))
        (d / "tokens").write_text(token_hash(TOKEN) + "\n")
        target = netns_model()
        target.model.save_pretrained(d / "target-model")
        perturbed_copy(target, noise=0.05, seed=3).model.save_pretrained(d / "draft-model")
        py = sys.executable
        bed.start("redis", [find_redis_server(), "--port", str(PORTS["redis"]), "--bind", bed.addr("redis"),
                            "--save", "", "--appendonly", "no", "--dir", str(d), "--protected-mode", "no"])
        for role, model_flag in (("target", "--target"), ("draft", "--draft")):
            cert, key = certs[role]
            # The target sleeps 25 ms per model call (specdec/bench/slow_service.py): a stream long enough to cut.
            program = [*SLOW_SERVICE, "target", "--delay-ms", "25"] if role == "target" else ["-m", "draft_service"]
            bed.start(role, [py, *program, "--host", bed.addr(role), "--port", str(PORTS[role]),
                             "--metrics-port", "-1", model_flag, str(d / f"{role}-model"), "--threads", "1",
                             "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca.cert])
        cert, key = coord_cert
        bed.start("coord", [py, "-m", "coordinator", "--host", bed.addr("coord"), "--port", str(PORTS["coord"]),
                            "--metrics-port", "-1", "--redis-url", f"redis://{bed.addr('redis')}:{PORTS['redis']}/0",
                            "--draft-replicas", f"{bed.addr('draft')}:{PORTS['draft']}",
                            "--target-replicas", f"{bed.addr('target')}:{PORTS['target']}",
                            "--tls-cert", cert, "--tls-key", key, "--token-file", str(d / "tokens"),
                            "--upstream-ca", ca.cert, "--upstream-cert", cert, "--upstream-key", key,
                            "--propose-deadline-s", "1", "--target-wait-s", "5"])
        _wait_ready(bed)
        yield bed
    finally:
        bed.remove()


def _wait_ready(bed: NetBed, timeout: float = 120.0) -> None:
    """Until a generation through all four namespaces works (bounded), or fail with the logs."""
    import asyncio

    from specdec.rpc.clients import CoordinatorClient

    async def once() -> bool:
        client = CoordinatorClient(bed.coordinator, tls=bed.client_tls(), token=TOKEN)
        try:
            out = await client.generate(client.request(token_ids=[1, 2, 3], max_tokens=4, method="draft"), timeout=10)
            return out.stats["drafted"] > 0  # the draft is reached too
        except Exception:  # noqa: BLE001 - not up yet
            return False
        finally:
            await client.close()

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        dead = [r for r, p in bed.procs.items() if p.poll() is not None]
        if dead:
            pytest.fail(f"{dead} exited while starting:\n{bed.logs()}", pytrace=False)
        if asyncio.run(once()):
            return
        time.sleep(0.5)
    pytest.fail(f"the namespaced stack did not answer within {timeout:.0f} s:\n{bed.logs()}", pytrace=False)
