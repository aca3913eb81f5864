"""The trainer's update on a GPU: step time, tokens/s, MFU and peak memory of one GRPO update
(``trainer.update.policy_update.run_updates``, bfloat16 mixed precision) on a randomly initialised model of
Qwen2.5-0.5B's shapes, for a full fine-tune and LoRA at rank 16 and 64.

    python -m bench.gpu_update                  # needs a CUDA device
    python -m bench.gpu_update --dry-run        # a tiny model on CPU: checks the code path only

No pretrained weights and no hub: the model is built from a config (the GPU machines carry
neither), and completions have a fixed length (random weights would end them anywhere), so
that timings compare across runs. Writes bench/results/gpu_update.json (not in a dry run).

MFU counts model FLOPs only (gradient checkpointing's recomputation is not counted), from
:func:`update_flops`, over the device's dense bfloat16 peak (:data:`PEAK_TFLOPS`, or
``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2Config

from jobspec import GRPOSpec, LoraSpec
from trainer.models.loading import disable_dropout, enable_gradient_checkpointing
from trainer.models.lora import apply_lora
from trainer.models.precision import enable_tf32
from trainer.update.batch import pack_batch
from trainer.update.optim import build_optimizer
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_update.json"
CONFIGS = ("full", "lora16", "lora64")
# Dense bfloat16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so the PCIe part comes before the SXM one.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def qwen25_05b_config() -> Qwen2Config:
    """Qwen2.5-0.5B's shapes (494M parameters, tied embeddings)."""
    return Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
    )


def tiny_config() -> Qwen2Config:
    """The same architecture at a size a CPU runs in a second (the dry run)."""
    return Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


@dataclass(frozen=True)
class Shape:
    rows: int  # completions in the batch (B)
    prompt_tokens: int  # P, every prompt
    completion_tokens: int  # T, every completion (no end token: random weights)
    micro_batch_size: int


def lora_rank(name: str) -> int | None:
    """``full`` -> None, ``lora16`` -> 16."""
    if name == "full":
        return None
    if name.startswith("lora") and name[4:].isdigit():
        return int(name[4:])
    raise ValueError(f"unknown configuration {name!r}: full or loraN (e.g. lora16)")


def update_flops(config: Qwen2Config, shape: Shape, *, lora_params: int | None) -> float:
    """Model FLOPs of one update over the batch.

    Forward: 2 per multiply-add of every decoder linear weight at every token, causal
    attention's QK^T and AV (2 * S^2 * heads * head_dim per layer and sequence), and the output
    head at the completion positions only (``trainer.update.logprobs`` applies it nowhere else). A
    full fine-tune's backward costs twice the forward (input and weight gradients); with LoRA
    the frozen base needs input gradients only (once the forward), plus 6 FLOPs per adapter
    parameter and token."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    seq = shape.prompt_tokens + shape.completion_tokens
    tokens = shape.rows * seq
    forward = (
        2 * layers * per_layer * tokens
        + 2 * layers * shape.rows * seq * seq * q
        + 2 * config.vocab_size * h * shape.rows * shape.completion_tokens
    )
    if lora_params is None:
        return float(3 * forward)
    return float(2 * forward + 6 * lora_params * tokens)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's dense bfloat16 peak: ``override``, else :data:`PEAK_TFLOPS` by name; None
    on CPU or an unknown device (MFU is then not reported)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def build_policy(config: Qwen2Config, device: torch.device, rank: int | None) -> nn.Module:
    """A seeded random model of ``config`` in float32 (the master weights) on ``device``,
    dropout off, gradient checkpointing on (the trainer's defaults), LoRA adapters of
    ``rank`` on every linear layer when given (B random, not 0, as after some training)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device)
    disable_dropout(model)
    enable_gradient_checkpointing(model)
    if rank is not None:
        model = apply_lora(model, LoraSpec(rank=rank, alpha=2 * rank))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
    return model


def grpo_spec(shape: Shape, *, gradient_checkpointing: bool = True) -> GRPOSpec:
    """The update's settings: bfloat16 mixed precision, one update over the batch, no KL."""
    return GRPOSpec.model_validate(
        {
            "dtype": "bfloat16",
            "prompts_per_step": 1,
            "group_size": shape.rows,
            "max_prompt_tokens": shape.prompt_tokens,
            "max_new_tokens": shape.completion_tokens,
            "micro_batch_size": shape.micro_batch_size,
            "gradient_checkpointing": gradient_checkpointing,
            "learning_rate": 1e-6,
        }
    )


def run_config(
    name: str,
    config: Qwen2Config,
    shape: Shape,
    device: torch.device,
    *,
    steps: int,
    peak: float | None,
) -> dict[str, Any]:
    """One warm-up update, then ``steps`` timed ones; the median step and what follows."""
    rank = lora_rank(name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_policy(config, device, rank)
    spec = grpo_spec(shape)
    optimizer = build_optimizer(model, spec)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(
        10,
        config.vocab_size,
        (shape.rows, shape.prompt_tokens + shape.completion_tokens),
        generator=generator,
    ).tolist()
    batch = pack_batch(
        [row[: shape.prompt_tokens] for row in ids],
        [row[shape.prompt_tokens :] for row in ids],
        [None] * shape.rows,
        [False] * shape.rows,
        torch.ones(shape.rows),
        device,
    )
    advantages = (torch.randint(0, 2, (shape.rows,), generator=generator) * 2 - 1).float()
    advantages = advantages.to(device)
    lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times, losses = [], []
    for step in range(steps + 1):
        _synchronize(device)
        start = time.perf_counter()
        stats, _ = run_updates(
            UpdateInputs(
                model=model,
                optimizer=optimizer,
                batch=batch,
                advantages=advantages,
                step=step,
                seed=0,
                old_logprobs=None,
                ref_logprobs=None,
                pad_id=0,
                guard=NonFiniteGuard(lambda *args, **kwargs: None),
                collect_pre_update=False,
            ),
            spec,
        )
        _synchronize(device)
        if step > 0:  # the first is the warm-up (allocations, kernel selection)
            times.append(time.perf_counter() - start)
            losses.append(stats.policy_loss)
    seconds = statistics.median(times)
    flops = update_flops(config, shape, lora_params=lora_params if rank is not None else None)
    tokens = shape.rows * (shape.prompt_tokens + shape.completion_tokens)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, optimizer, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": name,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / (peak * 1e12) if peak else None,
        "peak_memory_gib": peak_bytes / 2**30 if peak_bytes is not None else None,
        "trainable_params": lora_params,
        "policy_loss": losses,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_line(result: dict[str, Any]) -> str:
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (no known peak)"
    memory = result["peak_memory_gib"]
    peak = f", peak memory {memory:.2f} GiB" if memory is not None else ""
    return (
        f"{result['config']:>7}: step {result['step_s']:.3f} s, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops_per_s']:.1f} TFLOP/s, "
        f"MFU {mfu}{peak}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="full, loraN, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="timed updates (after a warm-up)")
    parser.add_argument("--rows", type=int, default=64, help="completions in the batch")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-tf32",
        action="store_true",
        help="leave float32 matmuls at full precision (the trainer turns TF32 on for CUDA; "
        "the output head's forward is exact float32 either way)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="a tiny model and batch on CPU (or the GPU if there is one): the code path only",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:
        lora_rank(name)  # an unknown name fails before any model is built
    if args.dry_run:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        config, shape = tiny_config(), Shape(4, 8, 8, 2)
        steps = 1
    else:
        if not torch.cuda.is_available():
            print(
                "bench.gpu_update measures the update on a CUDA device and found none; "
                "`python -m bench.gpu_update --dry-run` runs a tiny model on CPU to check the "
                "code path",
                file=sys.stderr,
            )
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        config = qwen25_05b_config()
        shape = Shape(args.rows, args.prompt_tokens, args.completion_tokens, args.micro_batch_size)
        steps = args.steps
    # What trainer.run.setup does for a job: TF32 for float32 matmuls (the head's backward, the
    # optimizer's float32 master weights), the head's forward kept exact by its own scope.
    tf32 = not args.no_tf32 and enable_tf32(device)
    peak = peak_tflops(device, args.peak_tflops)
    print(
        f"update on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: "
        f"{shape.rows} x ({shape.prompt_tokens} + {shape.completion_tokens}) tokens, "
        f"micro-batches of {shape.micro_batch_size}, bfloat16 autocast, TF32 {'on' if tf32 else 'off'}, "
        f"peak {peak if peak else 'unknown'} TFLOP/s"
    )
    results = []
    for name in names:
        result = run_config(name, config, shape, device, steps=steps, peak=peak)
        if not all(math.isfinite(x) for x in result["policy_loss"]):
            print(f"{name}: non-finite loss {result['policy_loss']}", file=sys.stderr)
            return 1
        results.append(result)
        print(format_line(result), flush=True)
    if not args.dry_run:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "benchmark": "gpu_update",
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "shape": asdict(shape),
            "peak_tflops": peak,
            "tf32": tf32,
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
