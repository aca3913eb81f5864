"""Two ranks train what one process trains: the same job (``resources.devices: 2``) run by
torchrun on 2 gloo ranks and by one process (which samples the job's two shares itself) ends
with the same parameters, within 1e-5 in float32, with the transformers engine, the vLLM
engine and LoRA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from jobspec import JobSpec
from trainer.run.loop import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERE = Path(__file__).resolve().parent
STEPS = 3


def two_device_spec(grpo: dict[str, Any] | None = None, **top: Any) -> JobSpec:
    data: dict[str, Any] = {
        "model": "tiny-random-llama",
        "dataset": {"rows": [{"prompt": f"say {w}"} for w in "abcdefgh"]},
        "graders": [{"type": "regex", "name": "has_seven", "pattern": "7"}],
        "grpo": {
            "steps": STEPS,
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 8,
            "max_prompt_tokens": 32,
            # AdamW turns float rounding of a gradient sum (two halves vs one pass: the only
            # difference) into up to ~1% of the learning rate per element; at 1e-4 that is
            # well inside the 1e-5 bound, while the weights still move by more than 1e-4.
            "learning_rate": 1e-4,
            "micro_batch_size": 4,
            "kl": {"estimator": "k3", "beta": 0.04, "placement": "loss"},
            **(grpo or {}),
        },
        "rollout": {"engine": "transformers"},
        "resources": {"devices": 2},
        "checkpoint_interval": 0,
        "seed": 0,
    }
    data.update(top)
    return JobSpec.model_validate(data)


def run_two_ranks(
    spec: JobSpec, out: Path, *, resume_from: Path | None = None, timeout: float = 600
) -> dict[str, Any]:
    """torchrun 2 ranks of ``spec`` (resumed from a checkpoint folder when given); rank 0's
    on_step metrics by step."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_DIST_TIMEOUT_S": "120"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(HERE / "rank_job.py"), str(spec_file), str(out),
            *([str(resume_from)] if resume_from is not None else []),
        ],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads((out / "rank0-steps.json").read_text()))


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    folder = out / f"checkpoint-{STEPS:06d}"
    name = (
        "adapter_model.safetensors"
        if (folder / "adapter_model.safetensors").exists()
        else ("model.safetensors")
    )
    return load_file(str(folder / name))


def assert_same_training(spec: JobSpec, tmp_path: Path) -> None:
    two = run_two_ranks(spec, tmp_path / "two")
    one: dict[int, dict[str, float]] = {}

    class Steps:  # the metrics one process reports
        pass

    from trainer.run.callbacks import Callbacks

    class Recorder(Callbacks):
        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            one[step] = metrics

    train(spec, Recorder(), output_dir=tmp_path / "one")
    assert sorted(int(k) for k in two) == list(range(1, STEPS + 1))
    # The runs trained on the same samples: same rewards and token counts every step.
    for step in range(1, STEPS + 1):
        names = ["reward/mean", "tokens/trained", "loss/policy", "grad_norm"]
        names += [n for n in ("eval/accuracy", "kl/reward_penalty") if n in one[step]]
        for name in names:
            assert name in two[str(step)], name
            assert two[str(step)][name] == pytest.approx(one[step][name], rel=1e-5, abs=1e-6)
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    assert a.keys() == b.keys()
    start = final_weights_of_base(spec)
    moved = 0.0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
        if name in start:
            moved = max(moved, float((b[name] - start[name]).abs().max()))
    if start:
        assert moved > 1e-4  # the weights did move: equal parameters are not equal start points


def final_weights_of_base(spec: JobSpec) -> dict[str, torch.Tensor]:
    """The packaged model's own weights (empty for a LoRA job, whose adapters start at 0)."""
    if spec.lora is not None:
        return {}
    from trainer.models.loading import load_policy, resolve_model

    model, _ = load_policy(resolve_model(spec.model), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_ranks_train_what_one_process_trains(tmp_path: Path) -> None:
    assert_same_training(two_device_spec(), tmp_path)


def test_two_ranks_with_lora_train_what_one_process_trains(tmp_path: Path) -> None:
    assert_same_training(
        two_device_spec(lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
        tmp_path,
    )


def test_two_ranks_with_vllm_engines_train_what_one_process_trains(tmp_path: Path) -> None:
    assert_same_training(two_device_spec(rollout={"engine": "vllm", "dtype": "float32"}), tmp_path)


def test_two_ranks_with_dynamic_sampling_and_kl_in_the_reward_train_what_one_process_trains(
    tmp_path: Path,
) -> None:
    # Dynamic sampling: rounds decided on every rank's groups (gathered), kept groups cut to a
    # multiple of the devices. KL in the reward: the penalty needs each rank's logprobs,
    # gathered before the advantages. Evaluation every step: each rank its share of the rows.
    spec = two_device_spec(
        grpo={
            "dynamic_sampling": {"enabled": True, "max_rounds": 3},
            "kl": {"estimator": "k1", "beta": 0.04, "placement": "reward"},
        },
        dataset={
            "rows": [{"prompt": f"say {w}", "answer": "7"} for w in "abcdefghijk"],
            "holdout": 3,
        },
        eval={"interval": 1, "max_rows": 3},
    )
    assert_same_training(spec, tmp_path)
