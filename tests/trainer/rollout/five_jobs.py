"""Five tiny jobs in this one process (the way a worker runs job after job); prints the RSS in
MiB after each (after gc and malloc_trim) as a JSON list. Run from the repository root by
tests/trainer/rollout/test_colocation.py: ``python five_jobs.py ENGINE``."""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.getcwd())  # the repository root: tests.* and trainer.*


def main(engine: str) -> list[float]:
    import psutil
    import torch

    from tests.trainer.test_loop import Recorder, tiny_spec
    from trainer.models.memory import release_free_memory
    from trainer.run.loop import train

    torch.set_num_threads(1)
    rss = []
    for _ in range(5):
        with tempfile.TemporaryDirectory() as out:
            spec = tiny_spec(
                steps=1,
                grpo={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                rollout={"engine": engine, "dtype": "float32"},
                checkpoint_interval=1,
            )
            train(spec, Recorder(), output_dir=Path(out))
        gc.collect()
        release_free_memory()
        rss.append(psutil.Process().memory_info().rss / 2**20)
    return rss


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
