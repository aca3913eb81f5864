"""The memory budget of reading a dataset's rows, the same for every format and reader.

A dataset file is small on the wire and can be huge once decoded: a Parquet dictionary page holds
one long string that thousands of records reference, compression shrinks it further, and even
plain JSON grows about twentyfold when it nests empty lists (``[]`` is 2 bytes of text and a
56-byte list object). Every reader (the API's JSONL, CSV and Parquet uploads, the workers' saved
datasets) therefore charges what it decodes to one :class:`RowBudget`:

- a row whose text is over :data:`MAX_ROW_BYTES`, or whose decoded size can be over
  :data:`MAX_ROW_DECODED_BYTES`, is refused before it is decoded, which bounds what one
  ``json.loads`` (or one record's conversion) can allocate;
- the decoded rows together may take at most :data:`MAX_DATASET_DECODED_BYTES` of Python memory,
  and the reader stops at the first row that would pass it. Text (a JSONL line, a CSV cell) is
  charged *before* it is decoded, at :func:`json_text_bound`, an upper bound on what CPython
  will allocate for it that costs a few byte counts instead of a decode; values another library
  already decoded (a saved dataset's records) are charged at their exact :func:`python_size`.

So reading any dataset costs at most the budget plus one row's worth of transient objects,
whatever its compression ratio, and a file past the budget is refused before most of it is
decoded.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_DATASET_DECODED_BYTES",
    "MAX_ROW_BYTES",
    "MAX_ROW_DECODED_BYTES",
    "RowBudget",
    "RowBudgetExceeded",
    "json_text_bound",
    "python_size",
    "text_record_bound",
]

# 100,000 rows (MAX_INLINE_ROWS) of a few hundred characters each decode to about 60-100 MiB of
# Python objects; a 16 MiB upload of ordinary rows to at most ~80 MiB. 256 MiB leaves room for
# long prompts while keeping one read well inside a process's share of the machine.
MAX_DATASET_DECODED_BYTES = 256 * 1024 * 1024
# One row's text: a prompt of MAX_TEXT_CHARS characters, an answer and grader fields fit many
# times over; a line over this is refused before json.loads sees it.
MAX_ROW_BYTES = 1024 * 1024
# One row's decoded size, at its upper bound: ordinary text rows are 1-5 times their text, so
# only rows built to expand (thousands of empty lists) reach it, and they are refused undecoded.
MAX_ROW_DECODED_BYTES = 16 * 1024 * 1024

# What CPython 3.11-3.13 (64-bit) allocates at most per JSON token, from sys.getsizeof:
_PER_QUOTE = 40  # a str is at most 80 bytes plus its characters; two quotes per str
_PER_BRACKET = 120  # a list of up to 4 items built by appending: 88; a number after it: 32
_PER_BRACE = 184  # a dict of up to 5 entries
_PER_COMMA = 42  # a list slot with growth slack (10), a number after it (32)
_PER_COLON = 80  # a dict entry with its table's slack (48), a number after it (32)


class RowBudgetExceeded(ValueError):
    """A row or the rows together decode to more than the budget allows; the message says which
    and by how much, in words a user can act on."""


def json_text_bound(text: str | bytes) -> int:
    """An upper bound on the bytes CPython allocates for ``json.loads(text)``: per character,
    1 byte when every string it can hold is ASCII, else 4; plus each token's object at its
    largest, counted from the quotes, brackets, braces, commas and colons in the text (those
    inside strings count too, which only raises the bound). Linear in C: no decoding."""
    if isinstance(text, bytes):
        wide = not text.isascii() or b"\\u" in text
        marks = (b'"', b"[", b"{", b",", b":")
        counts = [text.count(mark) for mark in marks]
    else:
        wide = not text.isascii() or "\\u" in text
        counts = [text.count(mark) for mark in ('"', "[", "{", ",", ":")]
    quotes, brackets, braces, commas, colons = counts
    return (
        (4 if wide else 1) * len(text)
        + _PER_QUOTE * quotes
        + _PER_BRACKET * brackets
        + _PER_BRACE * braces
        + _PER_COMMA * commas
        + _PER_COLON * colons
        + 32  # a lone number
    )


def text_record_bound(cells: Mapping[str, str]) -> int:
    """An upper bound on the bytes of a row built from text cells (a CSV record), each kept as
    text or decoded as JSON: the row's dict, an entry and a str object per cell, and the cell's
    :func:`json_text_bound` (which covers its decoded value too)."""
    return _PER_BRACE + sum(
        _PER_COLON + 2 * _PER_QUOTE + json_text_bound(v) for v in cells.values()
    )


def python_size(value: Any) -> int:
    """Bytes the decoded JSON value ``value`` (dicts, lists, str, int, float, bool, None) takes
    in CPython: each object's own size plus its contents'. Shared singletons (None, True,
    False) cost only the slot that refers to them. Iterative, so a deeply nested value cannot
    exhaust the interpreter's recursion limit."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or item is True or item is False:
            continue
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


class RowBudget:
    """A running count of decoded bytes against ``limit`` (default
    :data:`MAX_DATASET_DECODED_BYTES`); one per dataset read."""

    def __init__(
        self, limit: int = MAX_DATASET_DECODED_BYTES, row_limit: int = MAX_ROW_BYTES
    ) -> None:
        self.limit = limit
        self.row_limit = row_limit
        self.used = 0

    def check_row_text(self, size: int, where: str) -> None:
        """Refuse a row whose encoded text (or estimated decoded size) is ``size`` bytes when it
        is over the row limit, before anything decodes it. ``where`` names the row."""
        if size > self.row_limit:
            raise RowBudgetExceeded(
                f"{where} is {size} bytes, more than the {self.row_limit} bytes a row may take"
            )

    def charge_row(self, bound: int, where: str) -> None:
        """Charge one row at ``bound``, an upper bound on its decoded size, before it is
        decoded; RowBudgetExceeded when the row alone could pass MAX_ROW_DECODED_BYTES or the
        rows together the budget."""
        if bound > MAX_ROW_DECODED_BYTES:
            raise RowBudgetExceeded(
                f"{where} could decode to {bound} bytes, more than the "
                f"{MAX_ROW_DECODED_BYTES} a row may take (its text nests too many values)"
            )
        self.charge(bound, where)

    def charge(self, size: int, where: str) -> None:
        """Count ``size`` more decoded bytes; RowBudgetExceeded (naming ``where``, the row that
        crossed the limit) once the total passes the limit."""
        self.used += size
        if self.used > self.limit:
            raise RowBudgetExceeded(
                f"the rows up to {where} decode to more than {self.limit // (1024 * 1024)} MiB "
                f"(the limit for one dataset): split the dataset or shorten its rows"
            )

    def charge_value(self, value: Any, where: str) -> None:
        """Charge the decoded row ``value`` at its :func:`python_size`."""
        self.charge(python_size(value), where)

    def charge_text(self, text: str | bytes, where: str) -> None:
        """Charge the row ``text`` before it is decoded as JSON, at :func:`json_text_bound`."""
        self.charge_row(json_text_bound(text), where)
