"""Session-affine routing: consistent hashing moves only the sessions of a replica that leaves;
replica lists from flags, files and Kubernetes EndpointSlices."""

from __future__ import annotations

from kubernetes.client import (DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice,
                               V1ObjectMeta)

from coordinator.discovery import parse_replicas, ready_addresses
from coordinator.routing import HashRing

SESSIONS = [f"session-{i:05d}" for i in range(2000)]


def test_each_session_maps_to_one_replica_and_load_spreads():
    ring = HashRing(["a:1", "b:1", "c:1"])
    picks = [ring.pick(s) for s in SESSIONS]
    assert picks == [ring.pick(s) for s in SESSIONS], "routing is not deterministic"
    counts = {m: picks.count(m) for m in ring.members}
    assert min(counts.values()) > len(SESSIONS) / 3 * 0.6, counts


def test_removing_a_replica_moves_only_its_sessions():
    before = HashRing(["a:1", "b:1", "c:1"])
    after = HashRing(["a:1", "c:1"])
    for s in SESSIONS:
        if before.pick(s) != "b:1":
            assert after.pick(s) == before.pick(s)


def test_adding_a_replica_moves_sessions_only_onto_it():
    before = HashRing(["a:1", "b:1"])
    after = HashRing(["a:1", "b:1", "c:1"])
    moved = [s for s in SESSIONS if before.pick(s) != after.pick(s)]
    assert moved and all(after.pick(s) == "c:1" for s in moved)
    assert len(moved) < len(SESSIONS) / 2


def test_an_empty_ring_picks_nothing():
    assert HashRing([]).pick("session-00001") is None


def test_replica_lists_from_flags_and_files(tmp_path):
    assert parse_replicas("h1:1, h2:2,") == ["h1:1", "h2:2"]
    f = tmp_path / "targets.txt"
    f.write_text("# targets\n10.0.0.1:50062\n\n10.0.0.2:50062  # second\n")
    assert parse_replicas(f"@{f}") == ["10.0.0.1:50062", "10.0.0.2:50062"]


def test_ready_endpoints_from_endpoint_slices():
    def ep(ip, ready=True, terminating=False):
        return V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready, terminating=terminating))

    slices = [
        V1EndpointSlice(address_type="IPv4", metadata=V1ObjectMeta(name="t-1"),
                        ports=[DiscoveryV1EndpointPort(name="grpc", port=50062),
                               DiscoveryV1EndpointPort(name="metrics", port=9462)],
                        endpoints=[ep("10.1.0.5"), ep("10.1.0.6", ready=False), ep("10.1.0.7", terminating=True)]),
        V1EndpointSlice(address_type="IPv4", metadata=V1ObjectMeta(name="t-2"),
                        ports=[DiscoveryV1EndpointPort(name="grpc", port=50062)], endpoints=[ep("10.1.0.8")]),
    ]
    assert ready_addresses(slices, "grpc") == ["10.1.0.5:50062", "10.1.0.8:50062"]


def test_prefix_affinity_prefers_the_replica_that_read_the_longest_prefix_unless_it_is_much_busier():
    from coordinator.affinity import PrefixAffinity

    aff = PrefixAffinity(min_tokens=32, slack=2)
    doc = list(range(100, 164))  # 4 blocks
    aff.remember(doc[:32], "a:1")
    aff.remember(doc, "b:1")  # the longer prefix is on b
    idle = {"a:1": 0, "b:1": 0, "c:1": 0}.__getitem__
    live = ["a:1", "b:1", "c:1"]
    assert aff.home(doc + [5, 6], "c:1", live, idle) == "b:1"
    assert aff.home(doc[:40], "c:1", live, idle) == "b:1"  # remembered last for its first blocks too
    assert aff.home(doc[:20], "c:1", live, idle) == "c:1"  # under min_tokens: the ring
    assert aff.home([1, 2, 3] * 20, "c:1", live, idle) == "c:1"  # nothing remembered
    assert aff.home(doc, "c:1", ["a:1", "c:1"], idle) == "c:1"  # b is not live
    busy = {"a:1": 0, "b:1": 5, "c:1": 2}.__getitem__
    assert aff.home(doc, "c:1", live, busy) == "c:1"  # b runs 5 sessions, c 2: more than slack apart
    fair = {"a:1": 0, "b:1": 4, "c:1": 2}.__getitem__
    assert aff.home(doc, "c:1", live, fair) == "b:1"
    small = PrefixAffinity(max_prefixes=3)
    small.remember(doc, "a:1")  # 4 prefixes, the shortest forgotten
    assert len(small) == 3 and small.holder(doc[:16]) == (None, 0) and small.holder(doc) == ("a:1", 64)
