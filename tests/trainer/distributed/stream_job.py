"""Two ranks built with different seeds: ``torchrun ... stream_job.py OUT_JSON``.

Each rank builds a random Llama with a LoRA adapter (random B too, so merges are not the base)
from its own seed, then runs the start-up's broadcast and sharding, and streams the sharded
policy's weights into a recording engine in bfloat16 buckets under a tracking allocator. Rank 0
writes what it saw to OUT_JSON for ``test_streaming.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from transformers import LlamaConfig, LlamaForCausalLM

from jobspec.adaptation import LoraSpec
from tests.trainer.distributed.memory_tracking import LiveBytes
from trainer.distributed.sharding import broadcast_module, mesh_for, shard_model
from trainer.distributed.weights import WeightView, engine_buckets
from trainer.distributed.world import World, init_world, world_from_env
from trainer.models.lora import apply_lora, engine_state_dict

BUCKET = 16 << 10


class Recorder:
    """An engine that takes buckets: checks each tensor against the expected whole weights
    as it arrives and keeps only what it saw (no copies: it must not become a mirror)."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.expected = expected
        self.buckets: list[dict[str, Any]] = []
        self.names: list[str] = []
        self.mismatched: list[str] = []

    def load_weight_buckets(self, buckets: Any) -> float:
        for bucket in buckets:
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            dtypes = sorted({str(t.dtype) for _, t in bucket})
            self.buckets.append({"bytes": nbytes, "dtypes": dtypes, "size": len(bucket)})
            for name, tensor in bucket:
                self.names.append(name)
                want = self.expected.get(name)
                if want is None or not torch.equal(tensor, want):
                    self.mismatched.append(name)
        return 0.0


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = apply_lora(LlamaForCausalLM(config), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    return model


def _stream(model: torch.nn.Module, world: World, view: WeightView, expected: Any) -> Any:
    recorder = Recorder(expected)
    tracker = LiveBytes(None)
    tracker.adopt([*model.state_dict().values(), *model.parameters()])  # held already
    with tracker:
        baseline = tracker.live()
        buckets = engine_buckets(model, world, view=view, dtype=torch.bfloat16, bucket_bytes=BUCKET)
        recorder.load_weight_buckets(buckets)
    return {
        "buckets": recorder.buckets,
        "names": recorder.names,
        "expected": sorted(expected),
        "mismatched": recorder.mismatched,
        "extra_peak": tracker.peak - baseline,
    }


def main() -> None:
    torch.set_num_threads(1)
    world = world_from_env()
    init_world(world, torch.device("cpu"))
    model = _model(seed=100 + world.rank)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    broadcast_module(model, world, torch.device("cpu"))
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = {k: v.to(torch.bfloat16) for k, v in engine_state_dict(model).items()}
    adapter = {k: v.to(torch.bfloat16) for k, v in after.items() if ".lora_" in k}
    whole_bytes = sum(v.numel() * v.element_size() for v in after.values())
    shard_model(model, mesh_for(world, "cpu"))
    results = {
        "merged": _stream(model, world, "merged", merged),
        "adapter": _stream(model, world, "adapter", adapter),
        "whole_float32_bytes": whole_bytes,
        "bucket_bytes": BUCKET,
    }
    befores = world.gather_objects(before, "setup")
    afters = world.gather_objects(after, "setup")
    results["seeds_differed"] = any(
        not torch.equal(befores[0][k], befores[1][k]) for k in befores[0]
    )
    results["equal_to_rank0"] = all(
        torch.equal(afters[r][k], befores[0][k]) for r in range(world.size) for k in befores[0]
    )
    if world.is_main:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
