"""The adapter slot policy of an engine (inference.adapters), pure: each project holds at most
its share of the slots, a request pins its adapter only while it runs (its hold, or vLLM's
count of its running requests), and room is made from the project holding the most (issue 44:
one project's sampler saves held every slot and another project's model answered 503)."""

from __future__ import annotations

import pytest

from inference.adapters import (
    AdapterSlots,
    AllPinned,
    Evict,
    Fits,
    OverShare,
    default_share,
)
from inference.settings import build_inference_settings

FOREVER = 1e9


def _filled(slots: AdapterSlots, *adapters: tuple[str, str]) -> AdapterSlots:
    """``adapters`` (name, owner) used in order, one second apart."""
    for second, (name, owner) in enumerate(adapters, start=1):
        slots.use(name, owner, float(second))
    return slots


def test_the_default_share_is_half_the_slots_rounded_up() -> None:
    assert [default_share(c) for c in (1, 2, 3, 8, 9)] == [1, 1, 2, 4, 5]
    assert AdapterSlots(8).share == 4


def test_a_share_outside_one_to_the_engines_slots_is_refused() -> None:
    with pytest.raises(ValueError):
        AdapterSlots(0)
    with pytest.raises(ValueError):
        AdapterSlots(4, share=5)
    with pytest.raises(ValueError):
        AdapterSlots(4, share=0)


def test_the_setting_defaults_to_half_and_is_checked_against_max_adapters() -> None:
    assert build_inference_settings(max_adapters=8).adapter_share == 4
    assert build_inference_settings(max_adapters=3).adapter_share == 2
    settings = build_inference_settings(max_adapters=8, max_adapters_per_project=8)
    assert settings.adapter_share == 8
    with pytest.raises(ValueError, match=r"max_adapters_per_project \(9\) must be at most"):
        build_inference_settings(max_adapters=8, max_adapters_per_project=9)


def test_the_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_INFERENCE_MAX_ADAPTERS", "6")
    monkeypatch.setenv("GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT", "2")
    assert build_inference_settings().adapter_share == 2


def test_room_within_the_share_fits_without_evicting() -> None:
    slots = _filled(AdapterSlots(4, share=2), ("a1", "A"))
    assert not slots.needs_eviction("A")
    assert slots.make_room("A", now=10.0) == Fits()
    assert slots.make_room("B", now=10.0) == Fits()


def test_a_project_at_its_share_replaces_its_own_least_recently_used_adapter() -> None:
    """Free slots remain for the others: project A cycling through many adapters keeps two."""
    slots = _filled(AdapterSlots(4, share=2), ("a1", "A"), ("a2", "A"), ("b1", "B"))
    assert slots.needs_eviction("A") and not slots.full()
    assert slots.make_room("A", now=10.0) == Evict("a1", "A")
    slots.use("a1", "A", 11.0)  # a1 used again: a2 is now A's oldest
    assert slots.make_room("A", now=12.0) == Evict("a2", "A")


def test_a_project_whose_requests_use_its_whole_share_waits() -> None:
    slots = _filled(AdapterSlots(4, share=2), ("a1", "A"), ("a2", "A"))
    slots.hold("a1", "h1", until=FOREVER)
    slots.hold("a2", "h2", until=FOREVER)
    assert slots.make_room("A", now=10.0) == OverShare("A", held=2, share=2)
    # Another project still gets a free slot of the same engine.
    assert slots.make_room("B", now=10.0) == Fits()
    # One of A's requests ends: its adapter is A's to replace.
    assert slots.release("h2", 11.0)
    assert slots.make_room("A", now=12.0) == Evict("a2", "A")


def test_a_full_engine_evicts_from_the_project_holding_the_most() -> None:
    slots = _filled(
        AdapterSlots(6, share=3),
        ("b1", "B"),  # the oldest of all, but B holds one slot only
        ("a1", "A"),
        ("a2", "A"),
        ("a3", "A"),
        ("c1", "C"),
        ("c2", "C"),
    )
    assert slots.make_room("D", now=10.0) == Evict("a1", "A")
    slots.hold("a1", "h", until=FOREVER)  # the heaviest holder's oldest is pinned: its next
    assert slots.make_room("D", now=10.0) == Evict("a2", "A")


def test_when_the_heaviest_holder_uses_all_of_its_adapters_the_next_one_pays() -> None:
    slots = _filled(
        AdapterSlots(5, share=3), ("b1", "B"), ("a1", "A"), ("a2", "A"), ("a3", "A"), ("c1", "C")
    )
    for name in ("a1", "a2", "a3"):
        slots.hold(name, f"h-{name}", until=FOREVER)
    # B and C hold one each: the tie goes to the adapter used longest ago.
    assert slots.make_room("D", now=10.0) == Evict("b1", "B")


def test_every_slot_pinned_is_all_pinned_and_the_share_is_told_first() -> None:
    slots = _filled(AdapterSlots(2, share=1), ("a1", "A"), ("b1", "B"))
    slots.hold("a1", "ha", until=FOREVER)
    slots.hold("b1", "hb", until=FOREVER)
    assert slots.make_room("C", now=10.0) == AllPinned(capacity=2)
    # A is past its own share: that is what it is told (its own requests free it).
    assert slots.make_room("A", now=10.0) == OverShare("A", held=1, share=1)


def test_a_pin_lasts_while_requests_hold_it_not_for_a_window_after_its_use() -> None:
    """Two requests hold a1; it is pinned until both end, and free at once after."""
    slots = _filled(AdapterSlots(1, share=1), ("a1", "A"))
    slots.hold("a1", "first", until=FOREVER)
    slots.hold("a1", "second", until=FOREVER)
    assert slots.holds_on("a1", 10.0) == 2
    assert slots.release("first", 11.0)
    assert slots.make_room("B", now=11.0) == AllPinned(capacity=1)
    assert slots.release("second", 12.0)
    assert not slots.release("second", 12.0)  # twice is harmless
    assert slots.make_room("B", now=12.0) == Evict("a1", "A")  # a second after its use


def test_a_hold_never_released_lapses_at_its_deadline() -> None:
    slots = _filled(AdapterSlots(1, share=1), ("a1", "A"))
    slots.hold("a1", "lost", until=30.0)  # the gateway died before releasing it
    assert slots.make_room("B", now=29.9) == AllPinned(capacity=1)
    assert slots.make_room("B", now=30.0) == Evict("a1", "A")
    assert not slots.release("lost", 31.0)  # lapsed: nothing to release


def test_the_engines_running_requests_pin_their_adapters_too() -> None:
    """A request the engine still runs after its hold lapsed keeps its adapter."""
    slots = _filled(AdapterSlots(2, share=2), ("a1", "A"), ("b1", "B"))
    assert slots.make_room("C", now=10.0, in_use={"a1"}) == Evict("b1", "B")
    assert slots.make_room("C", now=10.0, in_use={"a1", "b1", "other"}) == AllPinned(2)


def test_a_release_counts_as_a_use_and_a_removal_drops_the_holds() -> None:
    slots = _filled(AdapterSlots(3, share=3), ("a1", "A"), ("a2", "A"), ("a3", "A"))
    slots.hold("a1", "h", until=FOREVER)
    slots.release("h", 10.0)
    assert slots.names() == ["a2", "a3", "a1"]
    slots.hold("a2", "h2", until=FOREVER)
    slots.remove("a2")
    assert "a2" not in slots and len(slots) == 2 and not slots.release("h2", 11.0)
    assert slots.owner_of("a1") == "A" and slots.held_by("A") == 2


def test_only_a_held_adapter_can_be_held() -> None:
    with pytest.raises(KeyError):
        AdapterSlots(1).hold("nowhere", "h", until=FOREVER)
