"""Object ids: a type prefix plus a time-ordered hex body, so ids sort by creation time and
cursor pagination can use the id alone."""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    millis = int(time.time() * 1000)
    return f"{prefix}_{millis:012x}{secrets.token_hex(8)}"
