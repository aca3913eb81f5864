"""The verified-key cache: a key is looked up in the database at most once per TTL per
process while no key is revoked (a revocation through the API or the CLI makes every entry
stale at once: tests/app/sessions/test_key_revocation.py), and a key revoked in the database by other
means stops working once that TTL has passed."""

from __future__ import annotations

from sqlalchemy import update

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import ApiKey
from app.core.security import VerifiedKeys
from app.sessions.service import KEY_CACHE_TTL_S
from tests.conftest import Api, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_the_ttl() -> None:
    clock = FakeClock()
    cache: VerifiedKeys[str] = VerifiedKeys(ttl_s=5, max_entries=10, clock=clock)
    cache.put("grpo_abc_secret", "principal")
    clock.now = 4.9
    assert cache.get("grpo_abc_secret") == "principal"
    clock.now = 5.0
    assert cache.get("grpo_abc_secret") is None
    assert cache.get("grpo_abc_other") is None  # never stored


def test_the_cache_is_bounded_and_keeps_no_plaintext() -> None:
    cache: VerifiedKeys[int] = VerifiedKeys(ttl_s=60, max_entries=3)
    for i in range(5):
        cache.put(f"grpo_p{i}_secret{i}", i)
    assert [cache.get(f"grpo_p{i}_secret{i}") for i in range(5)] == [None, None, 2, 3, 4]
    stored = repr(cache._entries)
    assert "secret" not in stored and "grpo_" not in stored


def test_an_entry_counts_only_under_the_epoch_it_was_verified_under() -> None:
    # The revocation counter moved (a key was revoked somewhere): every entry is stale.
    cache: VerifiedKeys[str] = VerifiedKeys(ttl_s=60, max_entries=10)
    cache.put("grpo_abc_secret", "principal", epoch=3)
    assert cache.get("grpo_abc_secret", epoch=3) == "principal"
    assert cache.get("grpo_abc_secret", epoch=4) is None
    assert cache.get("grpo_abc_secret", epoch=3) is None  # dropped, not kept for later


def test_a_zero_ttl_caches_nothing() -> None:
    cache: VerifiedKeys[str] = VerifiedKeys(ttl_s=0, max_entries=10)
    cache.put("grpo_abc_secret", "principal")
    assert cache.get("grpo_abc_secret") is None


def test_a_revoked_key_stops_working_within_the_cache_ttl(api: Api) -> None:
    key, _ = api.new_key()
    headers = {"Authorization": f"Bearer {key}"}
    assert api.client.get("/v1/jobs", headers=headers).status_code == 200  # cached now
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            prefix = key.split("_")[1]
            session.execute(
                update(ApiKey).where(ApiKey.prefix == prefix).values(revoked_at=utcnow())
            )
    finally:
        engine.dispose()
    wait_until(
        lambda: api.client.get("/v1/jobs", headers=headers).status_code == 401,
        KEY_CACHE_TTL_S + 10,  # the TTL, plus a margin for a busy machine
        "the revoked key to be refused",
    )
    # Another key of the same service is unaffected.
    assert api.client.get("/v1/jobs", headers=api.headers).status_code == 200
