"""LoRA weights into vLLM: merged push vs adapter hot-swap, on SmolLM2-135M (CPU).

    python -m bench.lora_sync [--ranks 16,64] [--repeats 5] [--out bench/results/lora_sync.json]

For each rank, one vLLM engine per mode (``rollout.lora_sync``): ``merged`` pushes every weight
with the adapters merged in float32; ``adapter`` saves the adapter and hot-swaps it as a vLLM
LoRA adapter. Measured per mode: the sync time (median of ``--repeats``, adapter B weights
redrawn each time so that every sync carries new values), and the rollout time of one batch
(8 prompts x 8 completions, 40 new tokens, the recipe's shape) with the synced weights, because
an adapter is applied at every decoding step while merged weights cost nothing extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from jobspec.adaptation import LoraSpec
from trainer.models.loading import load_policy, resolve_model
from trainer.models.lora import apply_lora
from trainer.rollout.registry import make_engine

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    f"What is {a}+{b}? Answer with a number." for a, b in zip(range(8), range(3, 11), strict=True)
]


def _redraw_adapters(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 1e-3)


def measure(mode: str, rank: int, repeats: int) -> dict[str, Any]:
    path = resolve_model("smollm2-135m-instruct")
    base, tokenizer = load_policy(path)
    policy = apply_lora(base, LoraSpec(rank=rank, alpha=2 * rank))
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    engine = make_engine(
        "vllm",
        path,
        tokenizer,
        dtype="float32",
        max_model_len=256,
        policy_model=policy,
        kv_cache_bytes=512 << 20,
        lora_rank=rank if mode == "adapter" else None,
    )
    try:
        syncs = []
        for i in range(repeats):
            _redraw_adapters(policy, seed=i)
            syncs.append(engine.sync_weights(policy))
        started = time.perf_counter()
        groups = engine.generate(prompts, 8, max_new_tokens=40, temperature=1.0, seed=0)
        rollout = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for g in groups for c in g)
    finally:
        engine.close()
    return {
        "mode": mode,
        "rank": rank,
        "sync_s": syncs,
        "sync_median_s": statistics.median(syncs),
        "rollout_s": rollout,
        "rollout_tokens": tokens,
        "rollout_tokens_per_s": tokens / rollout,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora_sync.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    results = []
    for rank in (int(r) for r in args.ranks.split(",")):
        for mode in ("merged", "adapter"):
            result = measure(mode, rank, args.repeats)
            results.append(result)
            print(
                f"r{rank} {mode}: sync {result['sync_median_s']:.3f}s (median), rollout "
                f"{result['rollout_s']:.1f}s ({result['rollout_tokens_per_s']:.0f} tok/s)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
