"""Which adapter is unloaded when an engine is full."""

from __future__ import annotations

import pytest

from inference.adapters import AdapterSlots


def test_no_victim_while_there_is_room() -> None:
    slots = AdapterSlots(2)
    slots.touch("a", 1.0)
    assert slots.victim(in_use=set(), kept_since=100.0) is None
    assert not slots.full()


def test_the_least_recently_used_goes_and_a_touch_makes_it_recent() -> None:
    slots = AdapterSlots(2)
    slots.touch("a", 1.0)
    slots.touch("b", 2.0)
    assert slots.victim(in_use=set(), kept_since=100.0) == "a"
    slots.touch("a", 3.0)
    assert slots.names() == ["b", "a"]
    assert slots.victim(in_use=set(), kept_since=100.0) == "b"


def test_an_adapter_in_use_or_just_ensured_is_kept() -> None:
    slots = AdapterSlots(2)
    slots.touch("a", 1.0)
    slots.touch("b", 50.0)
    assert slots.victim(in_use={"a"}, kept_since=10.0) is None  # a runs, b is recent
    assert slots.victim(in_use=set(), kept_since=10.0) == "a"
    assert slots.victim(in_use={"a"}, kept_since=60.0) == "b"


def test_removed_adapters_leave_room() -> None:
    slots = AdapterSlots(1)
    slots.touch("a", 1.0)
    slots.remove("a")
    assert "a" not in slots and len(slots) == 0


def test_an_engine_holds_at_least_one_adapter() -> None:
    with pytest.raises(ValueError):
        AdapterSlots(0)
