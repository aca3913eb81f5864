"""An open-loop HTTP load generator: requests start on a fixed schedule (request i at
start + i / rate) whether or not earlier ones have answered, so a slow server shows up as
latency instead of silently lowering the rate (the "coordinated omission" of closed-loop
clients).

A minimal HTTP/1.1 client on asyncio streams (keep-alive connections from a pool): on a 2-core
machine the client shares the CPU with the server it measures, and a full HTTP library
costs it several times more CPU per request. It speaks exactly what the API answers:
`Content-Length` bodies (FastAPI never sends chunked JSON), `Connection: close` honoured.

Latency is taken from the request's scheduled start (what a user waiting on it sees, client
lag included); `send_lag` says how late the client itself was, so a starved client is visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUEST_TIMEOUT_S = 30.0


@dataclass
class Sample:
    scheduled: float  # seconds since the run's start
    send_lag: float  # seconds between schedule and the moment it was written
    latency: float  # seconds from schedule to the last byte of the answer
    status: int  # HTTP status, 0 for a connection error or a timeout
    error: str | None = None


@dataclass
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used: bool = False  # answered a request before: the server may close it while idle


class Pool:
    """Keep-alive connections, at most `limit` open (a request beyond waits for one)."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port = host, port
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[Connection] = []

    async def acquire(self) -> Connection:
        await self.slots.acquire()
        if self.idle:
            return self.idle.pop()
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except BaseException:  # refused, or cancelled by the request's timeout
            self.slots.release()
            raise
        return Connection(reader, writer)

    def release(self, conn: Connection | None) -> None:
        """Give a connection back (None: it was closed)."""
        if conn is not None:
            self.idle.append(conn)
        self.slots.release()

    async def close(self) -> None:
        for conn in self.idle:
            conn.writer.close()
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()


async def _exchange(conn: Connection, request: bytes) -> tuple[int, bool]:
    """Write one request, read its answer; (status, keep the connection open)."""
    conn.writer.write(request)
    head = await conn.reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, keep = 0, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value.strip())
        elif name == "connection" and value.strip().lower() == "close":
            keep = False
    await conn.reader.readexactly(length)
    return status, keep


def build_request(
    method: str, host: str, port: int, path: str, headers: dict[str, str], body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _one(pool: Pool, request: bytes, scheduled: float, t0: float) -> Sample:
    """One request, bounded by REQUEST_TIMEOUT_S from its scheduled start (waiting for a free
    connection included), so an overloaded server cannot stretch the run without end."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    conn: Connection | None = None
    keep = False
    status, error = 0, None
    try:
        async with asyncio.timeout_at(scheduled + REQUEST_TIMEOUT_S):
            conn = await pool.acquire()  # on failure it has given its slot back itself
            sent = loop.time()
            try:
                status, keep = await _exchange(conn, request)
            except (ConnectionError, asyncio.IncompleteReadError):
                if not conn.used:
                    raise
                # The server closed this idle keep-alive connection just as we reused it
                # (uvicorn's keep-alive timeout): retry once on a new connection, as HTTP
                # clients do. uvicorn closes only idle connections, so the request was not
                # served (and a create carries its Idempotency-Key anyway).
                conn.writer.close()
                reader, writer = await asyncio.open_connection(pool.host, pool.port)
                conn = Connection(reader, writer)
                status, keep = await _exchange(conn, request)
            conn.used = True
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    if conn is not None:
        if not keep:
            conn.writer.close()
        pool.release(conn if keep else None)
    done = loop.time()
    return Sample(scheduled - t0, sent - scheduled, done - scheduled, status, error)


async def run_open_loop(
    host: str,
    port: int,
    make_request: Callable[[int], bytes],
    rate: float,
    seconds: float,
    max_connections: int = 64,
) -> list[Sample]:
    """Start request i at t0 + i / rate for `seconds`; every sample, in schedule order."""
    loop = asyncio.get_running_loop()
    pool = Pool(host, port, max_connections)
    total = int(rate * seconds)
    t0 = loop.time() + 0.05
    tasks: list[asyncio.Task[Sample]] = []
    for i in range(total):
        scheduled = t0 + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(pool, make_request(i), scheduled, t0)))
    samples = list(await asyncio.gather(*tasks))
    await pool.close()
    return samples


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summarize(samples: list[Sample], seconds: float) -> dict[str, Any]:
    """Latency percentiles (ms) of the answered requests and counts by outcome."""
    ok = [s for s in samples if 200 <= s.status < 300]
    by_status: dict[str, int] = {}
    for s in samples:
        by_status[str(s.status)] = by_status.get(str(s.status), 0) + 1
    span = max((s.scheduled + s.latency for s in samples), default=seconds)
    ms = [s.latency * 1000 for s in ok]
    lag = [s.send_lag * 1000 for s in samples]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "rate_429": by_status.get("429", 0),
        "errors": len(samples) - len(ok) - by_status.get("429", 0),
        "by_status": by_status,
        "error_examples": sorted({s.error for s in samples if s.error})[:5],
        "achieved_ok_per_s": round(len(ok) / span, 1) if span > 0 else None,
        "latency_ms": {
            q: (round(v, 1) if (v := percentile(ms, p)) is not None else None)
            for q, p in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("max", 100))
        },
        "client_send_lag_ms": {
            "p50": round(percentile(lag, 50) or 0, 1),
            "p99": round(percentile(lag, 99) or 0, 1),
        },
    }


def client_main(config_json: str) -> str:
    """Entry of the load process (run in its own interpreter): the config in, the summary and
    the samples out, both as JSON."""
    config = json.loads(config_json)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # plain asyncio works, with more client CPU per request
        pass
    body_template: dict[str, Any] = config["body"]
    keys: list[str] = config["keys"]
    run_id: str = config["run_id"]

    def make_request(i: int) -> bytes:
        body = dict(body_template, name=f"load-{i}")
        extra = {"Authorization": f"Bearer {keys[i % len(keys)]}"}
        if config["idempotency"]:
            extra["Idempotency-Key"] = f"{run_id}-{i}"
        return build_request(
            "POST", config["host"], config["port"], config["path"], extra, json.dumps(body).encode()
        )

    cpu0, wall0 = time.process_time(), time.perf_counter()
    samples = asyncio.run(
        run_open_loop(
            config["host"],
            config["port"],
            make_request,
            config["rate"],
            config["seconds"],
            config["max_connections"],
        )
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    summary = summarize(samples, config["seconds"])
    summary["client_cpu_share"] = round(cpu / wall, 3)
    summary["client_cpu_s"] = round(cpu, 3)
    return json.dumps(
        {"summary": summary, "samples": [[s.scheduled, s.latency, s.status] for s in samples]}
    )


if __name__ == "__main__":
    import sys

    print(client_main(sys.stdin.read()))
