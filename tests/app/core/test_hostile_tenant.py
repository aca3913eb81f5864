"""Attacks of a hostile tenant on the production shape (`grpo api` with two processes on
Postgres), RELIABILITY.md "Hostile tenant".

Uploads built to exhaust an API process's memory: Each is refused with a 4xx while the serving processes' peak
resident memory (VmHWM, read from the kernel, so no peak between two samples is missed) grows by
less than the stated bound: the dataset budget plus a few copies of the largest body
(jobspec/row_budget.py, RELIABILITY.md "Hostile tenant")."""

from __future__ import annotations

import io
import json
import socket
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core.settings import build_settings
from tests.app.conftest import ApiProcesses
from tests.conftest import wait_until

MiB = 1024 * 1024
MAX_BODY = build_settings().max_body_bytes
# An upload refused before its rows are decoded: the body as received and as read by the
# route, and allocator slack. JSONL and CSV are charged from their bytes before any row is
# decoded, Parquet from its footer and its dictionaries' sizes.
UNDECODED_BOUND = 4 * MAX_BODY + 64 * MiB
# The first Parquet upload a process reads imports pyarrow (the API starts without it).
PYARROW_IMPORT = 160 * MiB

ROWS = 5_000
LONG_TEXT = "x" * 1_000_000  # the bomb: one 1 MB string referenced by 5,000 rows


def parquet_bomb() -> bytes:
    """517 bytes of Parquet that decode to 5,000 rows of a 1 MB prompt: one dictionary page."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * ROWS, pa.int32()), pa.array([LONG_TEXT]))
    buffer = io.BytesIO()
    pq.write_table(pa.table({"prompt": column}), buffer, compression="zstd")
    return buffer.getvalue()


# Valid rows that expand the most: grader fields of empty lists (3 bytes of text, a 56-byte
# list each), each field under its 100,000 characters, each row under the per-row bound.
PAD = [[]] * 24_000  # 96,000 characters as json.dumps writes it ("[], [], ...")
FIELDS = ("p0", "p1", "p2")


def jsonl_expansion() -> bytes:
    """The most a JSONL body within the size limit can expand into rows that are valid."""
    row = {"prompt": "a", **{field: PAD for field in FIELDS}}
    line = json.dumps(row, separators=(",", ":")).encode()
    return b"\n".join([line] * (MAX_BODY // (len(line) + 1) - 1))


def csv_expansion() -> bytes:
    """The CSV form: the same fields as JSON cells (the csv module caps a cell at 131,072
    characters), records up to the body limit."""
    cell = '"' + json.dumps(PAD, separators=(",", ":")) + '"'
    record = ("a," + ",".join([cell] * len(FIELDS)) + "\n").encode()
    return f"prompt,{','.join(FIELDS)}\n".encode() + record * (MAX_BODY // len(record) - 1)


def upload(api: ApiProcesses, name: str, content: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{api.url}/v1/files",
        headers=api.headers,
        files={"file": (name, content)},
        data={"purpose": "fine-tune"},
        timeout=120,
    )
    return response, time.monotonic() - started


def growth(before: dict[int, int], after: dict[int, int]) -> int:
    return max(after[pid] - before.get(pid, after[pid]) for pid in after)


@pytest.mark.parametrize(
    ("name", "make", "bound"),
    [
        ("bomb.parquet", parquet_bomb, UNDECODED_BOUND + PYARROW_IMPORT),
        # JSONL and CSV are charged from their bytes before a row is decoded.
        ("expanding.jsonl", jsonl_expansion, UNDECODED_BOUND),
        ("expanding.csv", csv_expansion, UNDECODED_BOUND),
    ],
)
def test_an_expanding_upload_is_refused_within_the_memory_bound(
    api_processes: ApiProcesses, name: str, make: object, bound: int
) -> None:
    content = make()  # type: ignore[operator]
    assert len(content) <= MAX_BODY
    before = api_processes.peak_rss_bytes(reset=True)
    response, seconds = upload(api_processes, name, content)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
    assert response.json()["error"]["param"] == "file"
    grew = growth(before, api_processes.peak_rss_bytes())
    print(
        f"{name}: {len(content)} bytes, {response.status_code} in {seconds:.2f} s, "
        f"peak RSS +{grew / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    )
    assert grew < bound, (name, grew)
    # Both processes still serve (a process killed for memory would take its streams along).
    for _ in range(4):
        assert (
            httpx.get(f"{api_processes.url}/v1/files", headers=api_processes.headers).status_code
            == 200
        )


@pytest.mark.parametrize("name", ["same.jsonl", "same.csv"])
def test_the_same_rows_as_text_are_refused_by_the_body_limit(
    api_processes: ApiProcesses, name: str
) -> None:
    """The Parquet bomb's rows written as JSONL or CSV are 5 GB of text: the size limit refuses
    them from Content-Length, before a byte of the body is read (sent over a raw socket: HTTP
    clients will not declare a body they do not send)."""
    declared = ROWS * (len(LONG_TEXT) + 16)
    host, port = api_processes.url.removeprefix("http://").split(":")
    before = api_processes.peak_rss_bytes(reset=True)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(
            (
                f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: {api_processes.headers['Authorization']}\r\n"
                "Content-Type: multipart/form-data; boundary=b\r\n"
                f"Content-Length: {declared}\r\n\r\n--b\r\nContent-Disposition: form-data; "
                f'name="file"; filename="{name}"\r\n\r\n'
            ).encode()
        )
        status_line = connection.makefile("rb").readline().decode()
    assert status_line.split()[1] == "413", status_line
    assert growth(before, api_processes.peak_rss_bytes()) < UNDECODED_BOUND


def test_a_key_in_the_url_never_reaches_the_access_log(api_processes: ApiProcesses) -> None:
    """Clients that put a key in the query (`?key=`, `?api_key=`, `?token=`) leave it in the
    URL, which the access log writes: the value is replaced, the rest of the line kept."""
    secret = "grpo_leak_" + "s3cr3t" * 4
    marker = f"marker{time.monotonic_ns()}"
    for name in ("key", "api_key", "token"):
        response = httpx.get(
            f"{api_processes.url}/v1/files",
            params={name: secret, "order": "asc", "after": marker},
            headers=api_processes.headers,
        )
        assert response.status_code in (200, 400), response.text

    def logged() -> list[str]:
        return [line for line in api_processes.log().splitlines() if marker in line]

    lines = wait_until(lambda: len(logged()) == 3 and logged(), 20, "three access log lines")
    assert secret not in api_processes.log()
    for line, name in zip(lines, ("key", "api_key", "token"), strict=True):  # type: ignore[call-overload]
        assert f"?{name}=[redacted]&order=asc&after={marker} " in line, line
