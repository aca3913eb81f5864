"""Shared helpers of the benchmarks: machine/load snapshots, an RSS sampler, arithmetic prompts.

Stdlib (+ psutil when present) only, so that ``bench/trl_step.py`` (run in another venv, without
our package) can load this file by path too.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def load_snapshot() -> dict[str, Any]:
    """Load averages and the `uptime` line: other processes share this 2-core machine."""
    one, five, fifteen = os.getloadavg()
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout
    except OSError:
        line = ""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1m": one,
        "loadavg_5m": five,
        "loadavg_15m": fifteen,
        "uptime": line.strip(),
    }


def machine_info() -> dict[str, Any]:
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def system_cpu_ticks() -> dict[str, int]:
    """Machine-wide CPU ticks from /proc/stat (user, nice, system, idle, iowait, steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return {}
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {name: int(value) for name, value in zip(names, fields, strict=False)}


class CpuWindow:
    """CPU use over a timed window: this process's CPU seconds (all threads), the wall seconds,
    and how busy the whole machine was, so a slow figure can be told apart from a busy machine.

    ``process_share`` is CPU seconds per wall second (2.0 = both cores of a 2-core machine);
    ``machine_busy`` is the fraction of all cores' time that anything (us included) was running;
    ``steal`` is the fraction the hypervisor took away.
    """

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()
        self.ticks = system_cpu_ticks()

    def close(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        ticks = system_cpu_ticks()
        delta = {k: ticks.get(k, 0) - self.ticks.get(k, 0) for k in ticks}
        total = sum(delta.values()) or 1
        return {
            "wall_s": wall,
            "process_cpu_s": cpu,
            "process_share": cpu / wall if wall > 0 else float("nan"),
            "machine_busy": 1.0 - (delta.get("idle", 0) + delta.get("iowait", 0)) / total,
            "steal": delta.get("steal", 0) / total,
        }


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes() -> int:
    """RSS of this process plus its descendants now (this process's peak without psutil)."""
    try:
        import psutil
    except ImportError:
        return maxrss_bytes()
    proc = psutil.Process()
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class RSSSampler:
    """Samples the RSS of this process plus its descendants every ``interval`` seconds.

    ru_maxrss covers this process only; the sampler also counts any helper processes (vLLM can
    start some) and can be frozen at a chosen moment (``stop``), e.g. before a final checkpoint.
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RSSSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        """Take a last sample and freeze the peak; later calls change nothing."""
        if self._stop.is_set():
            return self.peak
        self._sample()
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak

    def _sample(self) -> None:
        self.peak = max(self.peak, current_rss_bytes())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)


def arithmetic_rows(count: int, seed: int = 0, lo: int = 0, hi: int = 9) -> list[dict[str, str]]:
    """``count`` "What is a+b? Answer with a number." rows with their answers (single digits by
    default: SmolLM2-135M-Instruct gets about a quarter right, so groups carry signal)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"prompt": f"What is {a}+{b}? Answer with a number.", "answer": str(a + b)})
    return rows


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
