"""Rows of an uploaded Parquet file, read within the dataset memory budget.

A Parquet file can declare a small size and decode to gigabytes: one long string in a dictionary
page that every record references, compressed to a few hundred bytes. So nothing is decoded
whole. The file is refused from its footer first (row count, leaf column count, row group count,
declared uncompressed size, column types); then it is read in record batches that keep every text column
dictionary-encoded, so a batch costs its distinct values and one index per record; each record's
decoded size is bounded from the Arrow buffers (string lengths, list offsets) and charged to the
:class:`~jobspec.row_budget.RowBudget` before any record of the batch becomes Python
objects.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from app.core.errors import InvalidRequest
from jobspec import MAX_INLINE_ROWS
from jobspec.row_budget import MAX_ROW_DECODED_BYTES, RowBudget

__all__ = ["MAX_PARQUET_COLUMNS", "MAX_PARQUET_ROW_GROUPS", "parquet_records"]

MAX_PARQUET_COLUMNS = 256  # leaf columns; a row is a prompt, an answer and grader fields
# Each row group is read as a batch of its own, at a fixed cost of a fraction of a millisecond
# (more under load): 45,000 one-row groups, 6.6 MB, took 6-40 s of an API process's CPU.
# Writers group rows by the hundred thousand or million (Hugging Face datasets by the thousand:
# 100 groups at the most rows a dataset holds), so no real file comes near this.
MAX_PARQUET_ROW_GROUPS = 1024
MAX_NESTING = 8  # list/struct levels below a column (messages: list<struct<string>> is 2)
BATCH_ROWS = 8192  # few batches: each carries the column chunk's whole dictionary
CHUNK_BYTES = 4 * 1024 * 1024  # estimated decoded bytes converted to Python at once
# Upper bounds of a Python object's own size before its contents, as CPython 3.12 lays them
# out (sys.getsizeof): the estimate is charged instead of the exact size, so it must not be less.
_STR_OBJECT = 49  # an ASCII str: 41 bytes, then one a character
_WIDE_STR_OBJECT = 80  # other text: up to 76 bytes, then up to 4 a character
_SCALAR_OBJECT = 32  # int (28 below 2**30, 4 more per 30 bits: parquet ints are 64-bit), float 24
_LIST_OBJECT = 56
_LIST_SLOT = 9  # 8 a reference, plus growth slack of a list built by appending
_DICT_OBJECT = 232  # an empty dict's table before its first resize
_DICT_ENTRY = 48  # hash, key and value references, and the index, with the table's slack

Record = tuple[int, dict[str, Any]]


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="file")


def _type_problem(data_type: pa.DataType, depth: int = 0) -> str | None:
    """Why a column of ``data_type`` cannot hold row fields (JSON values), or None."""
    if depth > MAX_NESTING:
        return f"nests more than {MAX_NESTING} levels"
    if pa.types.is_dictionary(data_type):
        return _type_problem(data_type.value_type, depth)
    if (
        pa.types.is_null(data_type)
        or pa.types.is_boolean(data_type)
        or pa.types.is_integer(data_type)
        or pa.types.is_floating(data_type)
        or pa.types.is_string(data_type)
        or pa.types.is_large_string(data_type)
    ):
        return None
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return _type_problem(data_type.value_type, depth + 1)
    if pa.types.is_struct(data_type):
        for field in data_type:
            problem = _type_problem(field.type, depth + 1)
            if problem is not None:
                return problem
        return None
    return f"has type {data_type}; rows hold text, numbers, booleans, lists and objects"


def _check_footer(parquet: pq.ParquetFile, budget: RowBudget) -> None:
    """Refuse from the footer alone: too many records or columns, a declared size over the
    budget, or a column type no row field can hold."""
    meta = parquet.metadata
    if meta.num_rows > MAX_INLINE_ROWS:
        raise _refuse(f"file has {meta.num_rows} rows, more than {MAX_INLINE_ROWS}")
    if meta.num_columns > MAX_PARQUET_COLUMNS:
        raise _refuse(f"file has {meta.num_columns} columns, more than {MAX_PARQUET_COLUMNS}")
    if meta.num_row_groups > MAX_PARQUET_ROW_GROUPS:
        raise _refuse(
            f"file has {meta.num_row_groups} row groups, more than {MAX_PARQUET_ROW_GROUPS}: "
            "write it with larger row groups (pyarrow's row_group_size; writers' defaults fit)"
        )
    declared = sum(
        meta.row_group(g).column(c).total_uncompressed_size
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    )
    if declared > budget.limit:
        raise _refuse(
            f"file declares {declared} bytes uncompressed, more than the {budget.limit} a "
            "dataset may decode to"
        )
    for field in parquet.schema_arrow:
        problem = _type_problem(field.type)
        if problem is not None:
            raise _refuse(f"column {field.name!r} {problem}")


def _costs(array: pa.Array) -> np.ndarray:
    """Estimated decoded bytes of each element of ``array`` (shape [len(array)], int64),
    computed from its buffers without converting any element to Python. Dictionary columns
    are charged per reference, so a value referenced by many records counts each time."""
    data_type = array.type
    if pa.types.is_dictionary(data_type):
        per_value = _costs(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        costs = per_value[indices] if len(per_value) else np.zeros(len(array), np.int64)
        return np.where(array.is_null().to_numpy(zero_copy_only=False), 0, costs)
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        lengths = pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        # CPython keeps ASCII text at a byte a character, other text at up to 4 bytes a
        # character (each at least one UTF-8 byte): an upper bound either way.
        ascii_text = pc.string_is_ascii(array).fill_null(True).to_numpy(zero_copy_only=False)
        return np.where(ascii_text, _STR_OBJECT, _WIDE_STR_OBJECT) + lengths.astype(
            np.int64
        ) * np.where(ascii_text, 1, 4)
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        child = np.concatenate([[0], np.cumsum(_costs(array.values))])
        inner = child[offsets[1:]] - child[offsets[:-1]]
        return inner + _LIST_OBJECT + _LIST_SLOT * np.diff(offsets)
    if pa.types.is_struct(data_type):
        total = np.full(len(array), _DICT_OBJECT, np.int64)
        for index in range(data_type.num_fields):
            total += _costs(array.field(index)) + _DICT_ENTRY
        return total
    return np.full(len(array), _SCALAR_OBJECT, np.int64)  # numbers, booleans, nulls


def _text_columns(parquet: pq.ParquetFile) -> list[str]:
    """Every text leaf column by its path, to be read as dictionary arrays."""
    schema = parquet.schema
    return [
        schema.column(i).path
        for i in range(len(schema))
        if schema.column(i).physical_type == "BYTE_ARRAY"
    ]


def parquet_records(content: bytes, budget: RowBudget) -> Iterator[Record]:
    """Each record of the Parquet file ``content`` as (record number from 1, its non-null
    fields), within ``budget``. InvalidRequest (param ``file``) for a file that is not Parquet,
    fails a footer check, or decodes past the budget; the budget's own error when a record is
    over the row limit."""
    try:
        parquet = pq.ParquetFile(io.BytesIO(content))
        _ = parquet.schema_arrow
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise _refuse(f"not a Parquet file ({type(exc).__name__})") from None
    _check_footer(parquet, budget)
    try:
        reopened = pq.ParquetFile(io.BytesIO(content), read_dictionary=_text_columns(parquet))
        batches = reopened.iter_batches(batch_size=BATCH_ROWS)
        number = 0
        for batch in batches:
            yield from _batch_records(batch, number, budget, parquet.schema_arrow)
            number += batch.num_rows
    except (pa.ArrowException, OSError) as exc:  # a corrupt page, a lying footer
        raise _refuse(f"the Parquet file could not be read: {exc}") from None
    except UnicodeDecodeError:
        # A text column is whatever bytes the writer stored: pyarrow checks none of them, and
        # decodes them only when a record becomes Python objects.
        raise _refuse(f"file is not UTF-8 text (a text column after record {number})") from None


def _batch_records(
    batch: pa.RecordBatch, before: int, budget: RowBudget, dense: pa.Schema
) -> Iterator[Record]:
    costs = np.full(batch.num_rows, _DICT_OBJECT, np.int64)
    for column in batch.columns:
        costs += _costs(column) + _DICT_ENTRY
    if batch.num_rows == 0:
        return
    too_big = np.flatnonzero(costs > MAX_ROW_DECODED_BYTES)
    if len(too_big):
        first = int(too_big[0])
        budget.charge_row(int(costs[first]), f"record {before + first + 1}")
    # The whole batch is charged before any record is built: records that each reference one
    # long dictionary value are refused here, unbuilt, naming the one that crosses the limit.
    total = np.cumsum(costs)
    over = np.flatnonzero(budget.used + total > budget.limit)
    last = int(over[0]) if len(over) else batch.num_rows - 1
    budget.charge(int(total[last]), f"record {before + last + 1}")
    # Then it is converted a few MiB of estimate at a time, so the Python objects of the batch
    # and its Arrow buffers are not all alive twice over.
    cuts = np.searchsorted(total, np.arange(CHUNK_BYTES, int(total[-1]), CHUNK_BYTES)).tolist()
    for start, end in zip([0, *cuts], [*cuts, batch.num_rows], strict=True):
        if end <= start:
            continue
        # Decoding the dictionaries first (a cast to the file's own schema) is five times faster
        # than converting dictionary arrays to Python, and the chunk is bounded by now.
        chunk = batch.slice(start, end - start).cast(dense)
        for offset, record in enumerate(chunk.to_pylist()):
            yield before + start + offset + 1, {k: v for k, v in record.items() if v is not None}
