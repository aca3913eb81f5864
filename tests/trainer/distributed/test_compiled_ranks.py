"""``grpo.compile`` with FSDP2 (trainer.update.compiled's order: the layers sharded, then
their forward compiled, FSDP's hooks outside it): a LoRA job on 2 gloo ranks trains exactly as
the same job without compile (the metrics of every step within 1e-6; aot_eager, see
compiled_rank_job.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec import JobSpec
from tests.trainer.distributed.test_equivalence import two_device_spec

pytestmark = [pytest.mark.process, pytest.mark.model]
HERE = Path(__file__).resolve().parent
NOISY = ("time/", "tokens_per_s/", "rank/")


def _two_ranks(spec: JobSpec, out: Path, script: str) -> dict[str, dict[str, float]]:
    out.mkdir(parents=True)
    (out / "spec.json").write_text(spec.model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_DIST_TIMEOUT_S": "300"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(HERE / script), str(out / "spec.json"), str(out),
        ],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "recompile_limit" not in proc.stderr  # every pass ran compiled
    return dict(json.loads((out / "rank0-steps.json").read_text()))


def test_a_compiled_lora_job_on_two_ranks_trains_as_the_eager_one(tmp_path: Path) -> None:
    lora = {"lora": {"rank": 4, "alpha": 8}}
    grpo = {"micro_batch_size": 2}  # several micro-batches: accumulation across passes
    eager = _two_ranks(two_device_spec(grpo, **lora), tmp_path / "eager", "rank_job.py")
    spec = two_device_spec({**grpo, "compile": True}, **lora)
    compiled = _two_ranks(spec, tmp_path / "compiled", "compiled_rank_job.py")
    for rank in (0, 1):  # each rank compiled its layers' graphs
        assert json.loads((tmp_path / "compiled" / f"rank{rank}-graphs.json").read_text()) > 0
    assert compiled.keys() == eager.keys() and len(compiled) == 3
    for step, metrics in compiled.items():
        figures = {k: v for k, v in metrics.items() if not k.startswith(NOISY)}
        assert figures.keys() == {k for k in eager[step] if not k.startswith(NOISY)}
        for name, value in figures.items():
            assert value == pytest.approx(eager[step][name], rel=1e-6, abs=1e-6), name
