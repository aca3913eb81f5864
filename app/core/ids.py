"""Object ids: a type prefix plus a time-ordered hex body, so ids sort by creation time and
cursor pagination can use the id alone."""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    millis = int(time.time() * 1000)
    return f"{prefix}_{millis:012x}{secrets.token_hex(8)}"


# What a cursor's numbers may be: each names a row id (BIGINT) or a step (INTEGER) that the
# query compares with, and a number past its column's range fails the query instead of
# matching nothing.
MAX_ID = 2**63 - 1
MAX_STEP = 2**31 - 1


def parse_number(text: str, maximum: int = MAX_ID) -> int | None:
    """The whole number ``text`` spells in ASCII digits (a row id, a step in a cursor) when it
    is at most ``maximum``, else None. ASCII only: str.isdigit also accepts '²' and other
    digits that int() refuses or reads as another number."""
    if text.isascii() and text.isdigit() and len(text) <= len(str(maximum)):
        number = int(text)
        return number if number <= maximum else None
    return None
