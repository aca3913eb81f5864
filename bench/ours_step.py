"""Our side of ``bench.step_vs_trl``: ``trainer.run.loop.train`` for a few steps, timed.

Started by ``bench.step_vs_trl`` in a fresh process per configuration (so the peak RSS is that
configuration's alone):

    .venv/bin/python -m bench.ours_step --config CONFIG.json --engine vllm --out RESULT.json

The callbacks record each step's metrics (``time/step`` and its phases ``time/rollout``,
``time/reward``, ``time/logprobs``, ``time/update``, ``time/weight_sync``) and the wall time
between consecutive ``on_step`` calls; the RSS sampler stops at the last step's ``on_step``, so
the final checkpoint write is not part of the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import (
    CpuWindow,
    RSSSampler,
    current_rss_bytes,
    load_snapshot,
    maxrss_bytes,
    write_json,
)

if TYPE_CHECKING:
    from jobspec import JobSpec
    from trainer.run.callbacks import Callbacks


def job_spec_dict(
    cfg: dict[str, Any],
    engine: str,
    dtype: str,
    kv_cache_gib: float | None = None,
    gradient_checkpointing: bool = True,
    train_dtype: str = "float32",
    lora_rank: int | None = None,
) -> dict[str, Any]:
    """The JobSpec (as a dict) equal to the TRL configuration of ``bench/trl_step.py``."""
    s = cfg["settings"]
    return {
        "name": f"bench-step-{engine}-{dtype}",
        "model": cfg["model_path"],
        "dataset": {
            "rows": cfg["rows"],
            "shuffle": False,  # TRL side: shuffle_dataset=False, so each step sees the same prompts
            "use_chat_template": True,
        },
        "graders": [{"type": "numeric_match"}],
        "grpo": {
            "steps": s["steps"],
            "prompts_per_step": s["prompts_per_step"],
            "group_size": s["group_size"],
            "learning_rate": s["learning_rate"],
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": s["max_grad_norm"],
            "max_new_tokens": s["max_new_tokens"],
            "max_prompt_tokens": 256,
            "temperature": s["temperature"],
            "eps_low": s["eps_low"],
            "eps_high": s["eps_high"],
            "kl": {"estimator": "k3", "beta": s["beta"], "placement": "loss"},
            "advantage_scale": "group",
            "loss_aggregation": "token_mean",
            "num_iterations": 1,
            "micro_batch_size": s["micro_batch_size"],
            "gradient_checkpointing": gradient_checkpointing,
            "dtype": train_dtype,
        },
        # alpha = 2r, all linear layers: the common LoRA defaults.
        "lora": None if lora_rank is None else {"rank": lora_rank, "alpha": 2 * lora_rank},
        "rollout": {"engine": engine, "dtype": dtype, "kv_cache_gib": kv_cache_gib},
        "seed": s["seed"],
        "checkpoint_interval": 0,
    }


def _parse() -> argparse.Namespace:
    """The command line ``bench.step_vs_trl`` builds for each of our configurations."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--engine", choices=["vllm", "transformers"], required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="vLLM KV cache (GiB; default: fit the batch)",
    )
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--train-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of rank")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def _job_spec(cfg: dict[str, Any], args: argparse.Namespace) -> JobSpec:
    """The validated JobSpec of this configuration."""
    from jobspec import JobSpec

    return JobSpec.model_validate(
        job_spec_dict(
            cfg,
            args.engine,
            args.dtype,
            args.kv_cache_gib,
            not args.no_gradient_checkpointing,
            args.train_dtype,
            args.lora_rank,
        )
    )


@dataclass
class Recording:
    """What the callbacks record: one row per step, the run's events, the setup's figures."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    setup: dict[str, float] = field(default_factory=dict)


def _recorder(
    recording: Recording,
    sampler: RSSSampler,
    started_process: float,
    engine: str,
    total: int,
) -> Callbacks:
    """Callbacks that fill `recording`, print each step's times, and stop `sampler` at the
    last step (defined here: the trainer is imported only once the RSS sampler runs)."""
    from trainer.run.callbacks import Callbacks, RunInfo

    steps, events, setup = recording.steps, recording.events, recording.setup

    class Recorder(Callbacks):
        def __init__(self) -> None:
            self.last: float | None = None
            self.window: CpuWindow | None = None

        def on_start(self, info: RunInfo) -> None:
            setup["seconds"] = time.perf_counter() - started_process
            setup["rss_bytes_after_setup"] = current_rss_bytes()
            setup["peak_rss_bytes_after_setup"] = sampler.peak
            self.last = time.perf_counter()
            self.window = CpuWindow()

        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            now = time.perf_counter()
            cpu = self.window.close() if self.window is not None else {}
            self.window = CpuWindow()
            record: dict[str, Any] = {
                "cpu": cpu,
                "step": step,
                "wall_since_previous": None if self.last is None else now - self.last,
                "loadavg_1m": os.getloadavg()[0],
                "rss_bytes": current_rss_bytes(),
                **metrics,
            }
            self.last = now
            steps.append(record)
            print(
                f"[ours/{engine}] step {step}: {metrics['time/step']:.1f} s (rollout "
                f"{metrics['time/rollout']:.1f}, logprobs {metrics['time/logprobs']:.1f}, update"
                f" {metrics['time/update']:.1f}, sync {metrics['time/weight_sync']:.1f})",
                flush=True,
            )
            if step >= total:
                sampler.stop()  # peak RSS over the training steps, before the checkpoint write

        def on_event(
            self,
            kind: str,
            message: str,
            level: str = "info",
            data: dict[str, object] | None = None,
        ) -> None:
            events.append(f"{level} {kind}: {message}")

    return Recorder()


def _add_library_versions(versions: dict[str, str], engine: str) -> None:
    """transformers' version, and vLLM's when it generated, into `versions` (where installed)."""
    try:
        import transformers

        versions["transformers"] = transformers.__version__
        if engine == "vllm":
            import vllm

            versions["vllm"] = vllm.__version__
    except ImportError:
        pass


def main() -> None:
    """Train this configuration in a scratch folder and write its timings and memory."""
    args = _parse()
    cfg = json.loads(args.config.read_text())
    sampler = RSSSampler().start()
    load_before = load_snapshot()
    started_process = time.perf_counter()

    import torch

    from trainer.run.loop import train

    spec = _job_spec(cfg, args)
    recording = Recording()
    recorder = _recorder(recording, sampler, started_process, args.engine, spec.grpo.steps)
    output_dir = Path(tempfile.mkdtemp(prefix="ours-bench-"))
    try:
        result_train = train(spec, recorder, output_dir=output_dir)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    sampler.stop()
    setup = recording.setup
    result: dict[str, Any] = {
        "side": "ours",
        "engine": f"{args.engine} ({args.dtype})",
        "training": f"{args.train_dtype}" + (f", LoRA r{args.lora_rank}" if args.lora_rank else ""),
        "versions": {"torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "job_spec": spec.model_dump(mode="json", exclude={"dataset": {"rows"}}),
        "setup_seconds": setup.get("seconds"),
        "rss_bytes_after_setup": setup.get("rss_bytes_after_setup"),
        "peak_rss_bytes_after_setup": setup.get("peak_rss_bytes_after_setup"),
        "final_step": result_train.final_step,
        "steps": recording.steps,
        "events": recording.events[:50],
        "peak_rss_bytes_sampled": sampler.peak,
        "peak_rss_bytes_ru_maxrss": maxrss_bytes(),
        "load_before": load_before,
        "load_after": load_snapshot(),
    }
    _add_library_versions(result["versions"], args.engine)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
