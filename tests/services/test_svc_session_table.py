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


def test_the_heap_is_trimmed_once_the_table_has_stayed_empty_and_not_between_back_to_back_sessions():
    import asyncio

    from specdec.service.memory import IdleTrim, trim_heap

    async def scenario():
        trims = []
        idle = IdleTrim(delay_s=0.05, trim=lambda: trims.append(len(table)))
        table = SessionTable(4, lambda sid: {"id": sid}, on_count=idle)
        table.get("a", create=True)
        table.release("a")  # empty: a trim is due in 50 ms ...
        await asyncio.sleep(0.01)
        table.get("b", create=True)  # ... but the next session came first
        await asyncio.sleep(0.1)
        no_trim_while_held = list(trims)
        table.release("b")
        await asyncio.sleep(0.1)
        return no_trim_while_held, trims, idle.trims

    held, trims, count = asyncio.run(scenario())
    assert held == [] and trims == [0] and count == 1  # one trim, with no session held
    import platform

    assert trim_heap() == (platform.libc_ver()[0] == "glibc")  # the call runs where the C library has it
