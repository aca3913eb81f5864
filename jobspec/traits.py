"""What a rollout engine is beyond its name: the traits code reads instead of comparing names.

An engine's traits say what starting it involves (``trainer.rollout.startup``) and which spec
settings it can serve (``JobSpec``'s validators). Torch-free, like the rest of the spec. Keys
must equal the spec's names (tests/trainer/test_registries.py), so a new engine is a row here
beside its entry in ``trainer.rollout.registry.ROLLOUT_ENGINES``. (A KL estimator's traits are
beside its name, in :mod:`jobspec.kl`.)
"""

from __future__ import annotations

from dataclasses import dataclass

from jobspec.grpo import RolloutEngineName

__all__ = ["ROLLOUT_ENGINE_TRAITS", "RolloutEngineTraits"]


@dataclass(frozen=True)
class RolloutEngineTraits:
    """What a run asks of one rollout engine besides building it."""

    # Loads the model from a folder: a ready model object is saved into one first.
    loads_folder: bool
    # Allocates its KV cache up front: the run sizes it (rollout.kv_cache_gib, or the batch).
    sizes_kv_cache: bool
    # On a CUDA device, shares it with the trainer: takes a share of its memory (given or
    # derived) and may sleep during updates (trainer.rollout.colocation).
    colocates_on_cuda: bool
    # Hot-swaps LoRA adapters instead of merged weights (rollout.lora_sync 'adapter').
    serves_lora_adapters: bool


ROLLOUT_ENGINE_TRAITS: dict[RolloutEngineName, RolloutEngineTraits] = {
    "vllm": RolloutEngineTraits(
        loads_folder=True, sizes_kv_cache=True, colocates_on_cuda=True, serves_lora_adapters=True
    ),
    # Generates with the policy module itself: nothing to load, size or share.
    "transformers": RolloutEngineTraits(
        loads_folder=False,
        sizes_kv_cache=False,
        colocates_on_cuda=False,
        serves_lora_adapters=False,
    ),
}
