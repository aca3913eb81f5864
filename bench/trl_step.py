"""TRL side of ``bench.step_vs_trl``: TRL's GRPOTrainer for a few steps, timed, in its own venv.

Runs in /work/main/.venv-trl (trl, transformers, torch; never our ``trainer`` package, whose
pinned transformers differs). ``bench.step_vs_trl`` writes a JSON config (model folder, prompt
rows, settings) and starts this script in a fresh process, so the peak RSS is this
configuration's alone:

    .venv-trl/bin/python bench/trl_step.py --config CONFIG.json --out RESULT.json

Timing: a TrainerCallback stamps on_step_begin/on_step_end (generation happens inside the step,
in the first micro-batch's input preparation). Phases are timed by wrapping GRPOTrainer methods:
``_generate`` (rollout), no-grad ``_get_per_token_logps_and_entropies`` (reference logprobs), and
``_generate_and_score_completions`` (rollout + reward + reference logprobs + advantages); the
rest of the step is the update (4 forward/backward micro-batches + optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    CpuWindow,
    RSSSampler,
    current_rss_bytes,
    load_snapshot,
    maxrss_bytes,
    write_json,
)

_NUMBER = re.compile(r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")


def _last_number(text: str) -> float | None:
    """The last number written in ``text`` (the same rule as our numeric_match grader for the
    integers this benchmark's answers are)."""
    for raw in reversed(_NUMBER.findall(text or "")):
        try:
            return float(raw.replace(",", ""))
        except ValueError:
            continue
    return None


def numeric_match(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        got, want = _last_number(text), _last_number(expected)
        out.append(1.0 if got is not None and want is not None and abs(got - want) <= 1e-6 else 0.0)
    return out


def _parse() -> argparse.Namespace:
    """The command line ``bench.step_vs_trl`` builds for TRL's configuration."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def _accumulation(s: dict[str, Any]) -> int:
    """Gradient accumulation steps: micro-batches per optimizer step (an error unless they
    divide the step's completions)."""
    completions_per_step = s["prompts_per_step"] * s["group_size"]
    if completions_per_step % s["micro_batch_size"]:
        raise ValueError("prompts_per_step * group_size must be a multiple of micro_batch_size")
    return int(completions_per_step // s["micro_batch_size"])


def _load_model(model_path: str) -> tuple[Any, Any]:
    """The tokenizer (left padding, a pad token) and the float32 model, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, local_files_only=True
    )
    return tokenizer, model


def _dataset(rows: list[dict[str, str]]) -> Any:
    """The prompt rows as TRL's conversational dataset (one user message, and the answer)."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )


def _prompt_tokens(tokenizer: Any, rows: list[dict[str, str]]) -> list[int]:
    """Each row's prompt length in tokens, chat template and generation prompt included."""
    return [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for r in rows
    ]


def _timed_trainer_class(phases: dict[str, float]) -> type:
    """GRPOTrainer with its rollout, reference-logprob and generate-and-score methods timed
    (seconds added to `phases`)."""
    import torch
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _generate(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate(*a, **k)
            finally:
                phases["rollout"] += time.perf_counter() - t

        def _get_per_token_logps_and_entropies(self, *a: Any, **k: Any) -> Any:
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*a, **k)
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*a, **k)
            finally:
                phases["ref_logprobs"] += time.perf_counter() - t

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                phases["generate_and_score"] += time.perf_counter() - t

    return TimedGRPOTrainer


@dataclass
class Recording:
    """What the step timer records: one row per step, TRL's logs, the setup's memory."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    setup: dict[str, int] = field(default_factory=dict)


def _step_timer(
    recording: Recording, phases: dict[str, float], sampler: RSSSampler, total_steps: int
) -> Any:
    """A TrainerCallback that times each step and its phases into `recording`, keeps TRL's
    logs, and stops `sampler` at the last step."""
    from transformers import TrainerCallback

    steps, logs, setup = recording.steps, recording.logs, recording.setup

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.begin = 0.0
            self.last_end: float | None = None
            self.window: CpuWindow | None = None

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            setup["rss_bytes_after_setup"] = current_rss_bytes()
            setup["peak_rss_bytes_after_setup"] = sampler.peak

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            for key in phases:
                phases[key] = 0.0
            self.begin = time.perf_counter()
            self.window = CpuWindow()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            end = time.perf_counter()
            seconds = end - self.begin
            cpu = self.window.close() if self.window is not None else {}
            record = {
                "cpu": cpu,
                "step": int(state.global_step),
                "seconds": seconds,
                "wall_since_previous_step_end": None
                if self.last_end is None
                else end - self.last_end,
                "rollout": phases["rollout"],
                "ref_logprobs": phases["ref_logprobs"],
                "generate_and_score": phases["generate_and_score"],
                "update": seconds - phases["generate_and_score"],
                "loadavg_1m": os.getloadavg()[0],
                "rss_bytes": current_rss_bytes(),
            }
            self.last_end = end
            steps.append(record)
            print(
                f"[trl] step {record['step']}: {seconds:.1f} s (rollout {phases['rollout']:.1f},"
                f" ref logprobs {phases['ref_logprobs']:.1f})",
                flush=True,
            )
            if state.global_step >= total_steps:
                sampler.stop()  # peak RSS over the training steps only

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            entry = dict(kwargs.get("logs") or {})
            entry["step"] = int(state.global_step)
            logs.append(entry)

    return StepTimer()


def _grpo_config(output_dir: str, s: dict[str, Any], accumulation: int) -> Any:
    """TRL's GRPOConfig at the benchmark's settings (the same as our side's JobSpec)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,  # fp32 like our side (TRL's default is bf16 mixed precision)
        fp16=False,
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=accumulation,
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"],
        beta=s["beta"],
        epsilon=s["eps_low"],
        epsilon_high=s["eps_high"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=s["steps"],
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=s["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def _effective_config(config: Any) -> dict[str, Any]:
    """The GRPOConfig's values after TRL's own defaults and derivations, as the JSON records."""
    return {
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "generation_batch_size": config.generation_batch_size,
        "steps_per_generation": config.steps_per_generation,
        "num_generations": config.num_generations,
        "gradient_checkpointing": config.gradient_checkpointing,
        "gradient_checkpointing_kwargs": config.gradient_checkpointing_kwargs,
        "bf16": config.bf16,
        "optim": str(config.optim),
        "loss_type": config.loss_type,
        "beta": config.beta,
        "epsilon": config.epsilon,
        "epsilon_high": config.epsilon_high,
        "scale_rewards": config.scale_rewards,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "temperature": config.temperature,
        "use_vllm": config.use_vllm,
        "disable_dropout": config.disable_dropout,
        "lr_scheduler_type": str(config.lr_scheduler_type),
        "mask_truncated_completions": config.mask_truncated_completions,
    }


def main() -> None:
    """Train TRL's configuration in a scratch folder and write its timings and memory."""
    args = _parse()
    cfg = json.loads(args.config.read_text())
    sampler = RSSSampler().start()
    load_before = load_snapshot()
    started_process = time.perf_counter()

    import tempfile

    import torch
    import transformers
    import trl

    s = cfg["settings"]
    accumulation = _accumulation(s)
    tokenizer, model = _load_model(cfg["model_path"])
    dataset = _dataset(cfg["rows"])
    prompt_tokens = _prompt_tokens(tokenizer, cfg["rows"])
    phases: dict[str, float] = {"rollout": 0.0, "ref_logprobs": 0.0, "generate_and_score": 0.0}
    recording = Recording()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as output_dir:
        config = _grpo_config(output_dir, s, accumulation)
        trainer = _timed_trainer_class(phases)(
            model=model,
            reward_funcs=[numeric_match],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[_step_timer(recording, phases, sampler, s["steps"])],
        )
        setup_s = time.perf_counter() - started_process
        trainer.train()
        effective = _effective_config(config)
    sampler.stop()
    result = {
        "side": "trl",
        "engine": "transformers generate (TRL default)",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "trl_config": effective,
        "setup_seconds": setup_s,
        "rss_bytes_after_setup": recording.setup.get("rss_bytes_after_setup"),
        "peak_rss_bytes_after_setup": recording.setup.get("peak_rss_bytes_after_setup"),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
        "steps": recording.steps,
        "logs": recording.logs,
        "peak_rss_bytes_sampled": sampler.peak,
        "peak_rss_bytes_ru_maxrss": maxrss_bytes(),
        "load_before": load_before,
        "load_after": load_snapshot(),
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
