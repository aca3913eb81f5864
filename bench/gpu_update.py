"""The trainer's update on a GPU: step time, tokens/s, MFU and peak memory of one GRPO update
(``trainer.update.policy_update.run_updates``, bfloat16 mixed precision) on a randomly initialised model of
Qwen2.5-0.5B's shapes, for a full fine-tune and LoRA at rank 16 and 64.

    python -m bench.gpu_update                  # needs a CUDA device
    python -m bench.gpu_update --dry-run        # a tiny model on CPU: checks the code path only
    python -m bench.gpu_update --heads fused    # the fused output head only (default: both)

No pretrained weights and no hub: the model is built from a config (the GPU machines carry
neither), and completions have a fixed length (random weights would end them anywhere), so
that timings compare across runs. Writes bench/results/gpu_update.json (not in a dry run).

Each configuration runs with the fused output head (``trainer.update.fused_head``, what the
trainer uses) and, for the before/after ratio from one run, the plain checkpointed head
(``--heads``); ``--compile`` applies ``torch.compile`` to each decoder layer, as a job with
``grpo.compile`` does (``trainer.update.compiled.compile_decoder_layers``).

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config

from bench.update_parts import (
    HEADS,
    Shape,
    build_policy,
    fixed_batch,
    grpo_spec,
    head_name,
    lora_rank,
    planned_update_bytes,
    qwen25_05b_config,
    timed_updates,
    tiny_config,
)
from trainer.models.precision import enable_tf32
from trainer.update.compiled import compile_decoder_layers
from trainer.update.logprobs import HeadPath

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_update.json"
CONFIGS = ("full", "lora16", "lora64")
# Dense bfloat16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so the PCIe part comes before the SXM one.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


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
    kv = (config.num_key_value_heads or config.num_attention_heads) * head_dim
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


def run_config(
    name: str,
    config: Qwen2Config,
    shape: Shape,
    device: torch.device,
    *,
    steps: int,
    peak: float | None,
    head: HeadPath = "fused",
    compile_decoder: bool = False,
) -> dict[str, Any]:
    """One warm-up update, then ``steps`` timed ones; the median step and what follows."""
    rank = lora_rank(name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_policy(config, device, rank)
    if compile_decoder:
        compile_decoder_layers(model)  # what a job with grpo.compile does
    batch, advantages = fixed_batch(config, shape, device)
    lora_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times, losses = timed_updates(model, grpo_spec(shape), batch, advantages, steps, head)
    seconds = statistics.median(times)
    flops = update_flops(config, shape, lora_params=lora_params if rank is not None else None)
    tokens = shape.rows * (shape.prompt_tokens + shape.completion_tokens)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    planned = None
    if device.type == "cuda" and config.vocab_size == qwen25_05b_config().vocab_size:
        total = torch.cuda.get_device_properties(device).total_memory
        planned = planned_update_bytes(shape, rank, total)
    del model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": name,
        "head": head,
        "compile": compile_decoder,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / (peak * 1e12) if peak else None,
        "peak_memory_gib": peak_bytes / 2**30 if peak_bytes is not None else None,
        # The memory plan's update bytes (jobspec.memory_plan) for the same update.
        "planned_gib": planned / 2**30 if planned is not None else None,
        "trainable_params": lora_params,
        "policy_loss": losses,
    }


def format_line(result: dict[str, Any]) -> str:
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (no known peak)"
    memory = result["peak_memory_gib"]
    peak = f", peak memory {memory:.2f} GiB" if memory is not None else ""
    if result.get("planned_gib") is not None:
        peak += f" (memory plan {result['planned_gib']:.2f} GiB)"
    return (
        f"{result['config']:>7}: step {result['step_s']:.3f} s, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops_per_s']:.1f} TFLOP/s, "
        f"MFU {mfu}{peak} ({result['head']} head)"
    )


def head_ratio(main: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``main``'s step time and peak memory over ``other``'s (same configuration, one run)."""
    memory = (main["peak_memory_gib"], other["peak_memory_gib"])
    return {
        "config": main["config"],
        "heads": f"{main['head']}/{other['head']}",
        "step": main["step_s"] / other["step_s"],
        "peak_memory": memory[0] / memory[1] if None not in memory else None,
    }


def format_ratio(other: dict[str, Any], ratio: dict[str, Any]) -> str:
    """The comparison head's figures and the ratios (no "tokens/s": one such line a config)."""
    memory = other["peak_memory_gib"]
    peak = f", peak {memory:.2f} GiB" if memory is not None else ""
    mem_ratio = ratio["peak_memory"]
    mem = f", peak memory {mem_ratio:.2f}x" if mem_ratio is not None else ""
    return (
        f"{other['config']:>7}: {other['head']} head step {other['step_s']:.3f} s{peak}; "
        f"{ratio['heads']}: step {ratio['step']:.2f}x{mem}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="full, loraN, comma-separated")
    parser.add_argument(
        "--heads",
        default=",".join(HEADS),
        help="output heads, comma-separated: the first is reported, each other one is compared "
        "with it (default fused,plain: the before/after ratio from one run)",
    )
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
        "--compile", action="store_true", help="torch.compile each decoder layer (off by default)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="a tiny model and batch on CPU (or the GPU if there is one): the code path only",
    )
    return parser


def _setting(args: argparse.Namespace) -> tuple[torch.device, Qwen2Config, Shape, int] | None:
    """Device, model config, shape and timed steps; None (after saying why) without CUDA."""
    if args.dry_run:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return device, tiny_config(), Shape(4, 8, 8, 2), 1
    if not torch.cuda.is_available():
        print(
            "bench.gpu_update measures the update on a CUDA device and found none; "
            "`python -m bench.gpu_update --dry-run` runs a tiny model on CPU to check the "
            "code path",
            file=sys.stderr,
        )
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    shape = Shape(args.rows, args.prompt_tokens, args.completion_tokens, args.micro_batch_size)
    return device, qwen25_05b_config(), shape, args.steps


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    heads = [head_name(h.strip()) for h in args.heads.split(",") if h.strip()]
    for name in names:
        lora_rank(name)  # an unknown name fails before any model is built
    setting = _setting(args)
    if setting is None:
        return 2
    device, config, shape, steps = setting
    # What trainer.run.setup does for a job: TF32 for float32 matmuls (the head's backward, the
    # optimizer's float32 master weights), the head's forward kept exact by its own scope.
    tf32 = not args.no_tf32 and enable_tf32(device)
    peak = peak_tflops(device, args.peak_tflops)
    print(
        f"update on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: "
        f"{shape.rows} x ({shape.prompt_tokens} + {shape.completion_tokens}) tokens, "
        f"micro-batches of {shape.micro_batch_size}, bfloat16 autocast, TF32 {'on' if tf32 else 'off'}, "
        f"peak {peak if peak else 'unknown'} TFLOP/s, compile {'on' if args.compile else 'off'}"
    )
    results: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    for name in names:
        first: dict[str, Any] | None = None
        for head in heads:
            result = run_config(
                name,
                config,
                shape,
                device,
                steps=steps,
                peak=peak,
                head=head,
                compile_decoder=args.compile,
            )
            if not all(math.isfinite(x) for x in result["policy_loss"]):
                print(f"{name}: non-finite loss {result['policy_loss']}", file=sys.stderr)
                return 1
            results.append(result)
            if first is None:
                first = result
                print(format_line(result), flush=True)
            else:
                ratios.append(head_ratio(first, result))
                print(format_ratio(result, ratios[-1]), flush=True)
    if not args.dry_run:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "benchmark": "gpu_update",
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "shape": asdict(shape),
            "peak_tflops": peak,
            "tf32": tf32,
            "compile": args.compile,
            "results": results,
            "head_ratios": ratios,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
