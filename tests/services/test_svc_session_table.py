"""The services' in-memory session table: LRU eviction, release, NotFound, the sessions gauge."""

import pytest

from specdec.errors import NotFound
from specdec.service.session_table import SessionTable


class Gauge:
    value = None

    def set(self, v):
        self.value = v


def test_least_recently_used_session_is_evicted_and_then_not_found():
    gauge = Gauge()
    table = SessionTable(2, lambda sid: {"id": sid}, gauge)
    a = table.get("a", create=True)
    table.get("b", create=True)
    assert table.get("a") is a  # "a" is now the most recently used
    table.get("c", create=True)
    assert list(table) == ["a", "c"] and gauge.value == 2
    with pytest.raises(NotFound, match="unknown session b: prefill it first"):
        table.get("b")
    assert table.active_recently() == 2  # the evicted session no longer counts
    assert table.release("a") and not table.release("a")
    assert "a" not in table and len(table) == 1 and gauge.value == 1
