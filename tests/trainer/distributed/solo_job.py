"""One rank of a two-rank group where rank 0 works alone in a phase: ``python solo_job.py RANK
PORT TIMEOUT_S WORK_S OUT_DIR MODE``, with the job's store served at PORT (the test's). Rank 0 writes ``OUT_DIR/working`` when its work starts and
then works WORK_S seconds; the phase's result is broadcast. MODE ``solo`` waits for it with
``World.main_alone`` (the heartbeat), ``plain`` in the broadcast alone (the collective bounded
by the world's timeout), ``raise`` has rank 0 fail in the phase. Each rank writes what it got
to ``OUT_DIR/rank<R>.json``: ``{"got": ...}`` or ``{"error": ..., "phase": ...}``."""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch.distributed as dist

from trainer.distributed.world import World
from trainer.errors import DistributedTimeout


def main(rank: int, port: int, timeout_s: float, work_s: float, out: Path, mode: str) -> None:
    # The store is the test's (as torchrun's agent holds a job's): freezing rank 0 leaves it.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s)
    )
    world = World(rank=rank, size=2, timeout_s=timeout_s)
    result: dict[str, object]
    try:
        made = None
        with world.main_alone("collect") if mode != "plain" else nullcontext():
            if world.is_main:
                (out / "working").touch()
                time.sleep(work_s)
                if mode == "raise":
                    raise ValueError("rank 0's rollouts failed")
                made = {"batch": [1, 2, 3], "version": 4}
        result = {"got": world.broadcast_object(made, "collect")}
    except DistributedTimeout as exc:
        result = {"error": str(exc), "phase": exc.phase}
    except ValueError as exc:
        result = {"error": str(exc), "phase": "collect"}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    rank, port, timeout_s, work_s, out, mode = sys.argv[1:7]
    main(int(rank), int(port), float(timeout_s), float(work_s), Path(out), mode)
