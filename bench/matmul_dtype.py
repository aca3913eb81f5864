"""float32 vs bfloat16 matmul speed on this machine's CPU, the shapes of a SmolLM2-135M layer.

    .venv/bin/python -m bench.matmul_dtype

Whether ``grpo.dtype: bfloat16`` can pay off on a CPU depends on the CPU: with avx512_bf16 or
AMX, oneDNN has bfloat16 kernels; without them bfloat16 matmuls fall back to slow generic code.
This prints and records the CPU's flags, whether oneDNN reports bfloat16 support, and the time
of one [rows, 576] x [576, 1536] product (an MLP projection) in each dtype, on one thread,
interleaved. Writes bench/results/matmul_dtype.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, load_snapshot, machine_info, median, write_json


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx")))
    except OSError:
        pass
    return []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="tokens in the micro-batch")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "matmul_dtype.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 576, generator=generator)
    w = torch.randn(1536, 576, generator=generator)
    inputs = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in inputs}
    before = load_snapshot()
    for _ in range(args.repeats + 1):  # the first round warms up
        for dtype, (a, b) in inputs.items():
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            times[dtype].append(time.perf_counter() - start)
    result = {
        "benchmark": "matmul_dtype",
        "command": "python -m bench.matmul_dtype",
        "machine": machine_info(),
        "cpu_flags": _cpu_flags(),
        "onednn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "shape": f"[{args.rows}, 576] x [576, 1536]",
        "median_ms": {str(d).split(".")[1]: median(t[1:]) * 1e3 for d, t in times.items()},
        "load_before": before,
        "load_after": load_snapshot(),
    }
    result["bf16_over_fp32"] = result["median_ms"]["bfloat16"] / result["median_ms"]["float32"]
    write_json(args.out, result)
    print(
        f"flags {' '.join(result['cpu_flags'])}; oneDNN bf16 {result['onednn_bf16_supported']}; "
        f"float32 {result['median_ms']['float32']:.1f} ms, bfloat16 "
        f"{result['median_ms']['bfloat16']:.1f} ms ({result['bf16_over_fp32']:.1f}x)"
    )


if __name__ == "__main__":
    main()
