"""What an idle release costs a Tinker client (docs/tinker.md, "Idle release"): a resident
resident model written to disk whole (``ResidentModel.suspend``: adapter, Adam state,
pending gradients, sampler weights kept in memory) and read back (``ResidentModel.resume``),
against building the session from its base model (what a worker does for a new client), on the
packaged models.

    .venv/bin/python -m bench.tinker_idle_release                      # smollm2, ranks 8 and 32
    .venv/bin/python -m bench.tinker_idle_release --model tiny-random-llama --ranks 8

For each rank: one forward_backward + optim_step, then a forward_backward left pending and one
sampler snapshot kept; then ``--repeats`` times: build a fresh session (the load a new client
pays), suspend the trained one to a new folder, resume it. Reports the median seconds of each,
the folder's bytes, and whether the resumed session's next step equals the resident one's (it
must, bit for bit). Results: bench/results/tinker_idle_release.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from jobspec.checkpoint_files import folder_bytes
from trainer.models.loading import resolve_model
from trainer.primitives import Datum, ResidentModel

RESULTS = Path(__file__).with_name("results") / "tinker_idle_release.json"


def _batch(vocab: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(0)
    data = []
    for n in (96, 64, 128, 32):
        tokens = torch.randint(1, vocab, (n,), generator=generator).tolist()
        targets = torch.randint(1, vocab, (n,), generator=generator).tolist()
        data.append(Datum(tokens, {"target_tokens": targets}))
    return data


def _timed(work: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = work()
    return time.perf_counter() - start, out


def measure(model: str, rank: int, repeats: int, workdir: Path) -> dict[str, Any]:
    path = resolve_model(model)
    session = ResidentModel(path, lora_rank=rank, seed=0)
    batch = _batch(session.vocab_size)
    session.forward_backward(batch, "cross_entropy")
    session.optim_step(learning_rate=1e-3)
    session.forward_backward(batch, "cross_entropy")  # pending when the client goes quiet
    snapshots = {"sampler": session.snapshot()}
    build, suspend, resume = [], [], []
    size = 0
    resumed = session
    for n in range(repeats):
        seconds, _ = _timed(lambda: ResidentModel(path, lora_rank=rank, seed=0))
        build.append(seconds)
        folder = workdir / f"{model}-{rank}-{n}"
        seconds, _ = _timed(lambda folder=folder: session.suspend(folder, snapshots))
        suspend.append(seconds)
        size = folder_bytes(folder)
        seconds, (resumed, _) = _timed(lambda folder=folder: ResidentModel.resume(folder, path))
        resume.append(seconds)
    session.optim_step(learning_rate=1e-3)
    resumed.optim_step(learning_rate=1e-3)
    same = (
        session.forward_backward(batch, "cross_entropy").metrics["loss:sum"]
        == resumed.forward_backward(batch, "cross_entropy").metrics["loss:sum"]
    )
    return {
        "model": model,
        "lora_rank": rank,
        "build_s": statistics.median(build),
        "suspend_s": statistics.median(suspend),
        "resume_s": statistics.median(resume),
        "folder_bytes": size,
        "next_step_equal": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", default="8,32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in (int(r) for r in args.ranks.split(",")):
            row = measure(args.model, rank, args.repeats, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
