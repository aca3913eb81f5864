"""Seeds derived from the run's seed, so that every rollout call and every minibatch split has a
stream of its own that does not depend on what ran before it (a resumed run matches the
straight one). Used by the rollout collection, the update and the evaluation."""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers, e.g. (run seed, step, round): independent streams for
    every rollout call that do not depend on what ran before (so a resumed run matches)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
