"""The memory arithmetic: who is evicted to make room, and when nothing can be."""

from __future__ import annotations

import pytest

from inference.budget import Holder, NeverFits, engine_cost, plan_evictions

GB = 1_000_000_000


def test_an_engine_costs_its_weights_kv_cache_and_overhead() -> None:
    assert engine_cost(weight_bytes=3, kv_cache_bytes=5, overhead_bytes=7) == 15


def test_nothing_is_evicted_while_the_engine_fits() -> None:
    holders = [Holder("a", 3 * GB, 1.0, True)]
    assert plan_evictions(holders, need=5 * GB, budget=8 * GB) == []


def test_the_least_recently_used_idle_engines_go_first_and_only_as_many_as_needed() -> None:
    holders = [
        Holder("newest", 2 * GB, 30.0, True),
        Holder("oldest", 2 * GB, 10.0, True),
        Holder("middle", 2 * GB, 20.0, True),
    ]
    assert plan_evictions(holders, need=5 * GB, budget=8 * GB) == ["oldest", "middle"]
    assert plan_evictions(holders, need=4 * GB, budget=8 * GB) == ["oldest"]


def test_an_engine_in_use_is_never_evicted_even_when_oldest() -> None:
    holders = [Holder("busy", 4 * GB, 1.0, False), Holder("idle", 4 * GB, 9.0, True)]
    assert plan_evictions(holders, need=4 * GB, budget=8 * GB) == ["idle"]


def test_no_plan_when_the_engines_in_use_hold_the_room() -> None:
    holders = [Holder("busy", 6 * GB, 1.0, False), Holder("idle", 1 * GB, 2.0, True)]
    assert plan_evictions(holders, need=3 * GB, budget=8 * GB) is None


def test_an_engine_larger_than_the_budget_never_fits() -> None:
    with pytest.raises(NeverFits):
        plan_evictions([], need=9 * GB, budget=8 * GB)
