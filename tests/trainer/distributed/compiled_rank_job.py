"""A rank of a test job with ``grpo.compile``, compiled with AOTAutograd and eager kernels
(``aot_eager``: inductor's C++ build would take minutes per rank on the test machine):
``torchrun ... compiled_rank_job.py SPEC_JSON OUTPUT_DIR``, otherwise rank_job.py itself; each
rank then writes how many graphs dynamo built to ``OUTPUT_DIR/rank<N>-graphs.json``."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from torch._dynamo.utils import counters

import trainer.update.compiled as compiled_module

if __name__ == "__main__":
    compiled_module.COMPILE_BACKEND = "aot_eager"
    out = Path(sys.argv[2])
    runpy.run_path(str(Path(__file__).with_name("rank_job.py")), run_name="__main__")
    graphs = int(counters["stats"]["unique_graphs"])
    (out / f"rank{os.environ.get('RANK', '0')}-graphs.json").write_text(json.dumps(graphs))
