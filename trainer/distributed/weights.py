"""Whole weights out of a sharded policy, streamed: for the rank's own rollout engine, and for
the module the transformers engine generates with.

Every rank walks the sharded policy's ``state_dict`` in the same order and gathers each tensor
whole (``full_tensor()``, a collective), cast to the engine's dtype before the gather (a
bfloat16 engine receives bfloat16 and the gather moves half the bytes). The tensors are packed
into buckets of at most ``bucket_bytes`` (:data:`DEFAULT_BUCKET_BYTES`; a single larger tensor
is a bucket of its own), and a bucket is handed on only once every gather of it has finished.
So the collectives stay in lockstep on every rank whatever the engines do between buckets:
one rank's engine asking for a tensor its peers have not gathered yet is the deadlock TRL and
open-instruct hit, and it cannot happen when an engine only ever sees whole buckets. No rank
keeps a full copy: at most the bucket the engine is loading and the one being gathered.

A LoRA policy streams either its merged weights under the base model's names (``W + B @ A *
scale`` computed in float32 from the gathered pieces, as ``trainer.models.lora.engine_weights``
does on one process) or, for an engine that serves adapters, the adapter tensors alone.
Every gather runs under the world's timeout, in phase ``sync``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from trainer.distributed.world import World
from trainer.models.precision import copy_module

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "Mirror",
    "WeightView",
    "bucketed",
    "engine_buckets",
    "whole_tensors",
]

DEFAULT_BUCKET_BYTES = 256 << 20
Bucket = list[tuple[str, Tensor]]
# What an engine is given: the policy's own state_dict (a module copy of it, the transformers
# engine), the merged weights under the base's names (vLLM), or a LoRA adapter alone.
WeightView = Literal["state_dict", "merged", "adapter"]
_PEFT_PREFIX = "base_model.model."


def whole_tensors(
    sharded: nn.Module,
    world: World,
    *,
    dtype: torch.dtype | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``sharded``'s state_dict entries whole, one at a time, in order, each in ``dtype``
    (None: its own). ``keep`` filters by name BEFORE the gather: every rank must pass the same
    filter (a name decides it, and names are equal on every rank)."""
    with torch.no_grad():
        for name, value in sharded.state_dict().items():
            if keep is not None and not keep(name):
                continue
            cast = value if dtype is None else value.detach().to(dtype)
            with world.phase("sync"):
                whole = cast.full_tensor() if isinstance(cast, DTensor) else cast
            yield name, whole.detach()


def bucketed(tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """``tensors`` packed in order into buckets of at most ``bucket_bytes`` (a tensor larger
    than that alone). A bucket is yielded after its last tensor was produced, so every gather
    behind it has finished."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _lora_scales(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """Each adapted layer's state_dict prefix -> (scale, fan_in_fan_out) of the job's adapter."""
    out: dict[str, tuple[float, bool]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            fan = bool(getattr(module, "fan_in_fan_out", False))
            out[f"{name}."] = (float(module.scaling["default"]), fan)
    return out


def _engine_name(key: str) -> str:
    """A PeftModel state_dict key under the base model's Hugging Face name."""
    return key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def merged_tensors(
    whole: Iterable[tuple[str, Tensor]], scales: dict[str, tuple[float, bool]], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """A LoRA policy's whole float32 state_dict entries as the engine's merged weights in
    ``dtype``: an adapted layer's ``base_layer.weight`` [out, in] is held until its
    ``lora_A`` [r, in] and ``lora_B`` [out, r] arrive (peft registers them after it), then
    ``W + B @ A * scale`` goes out under the base's name; adapter tensors are left out."""
    pending: dict[str, dict[str, Tensor]] = {}
    for key, tensor in whole:
        prefix = next((p for p in scales if key.startswith(p)), None)
        if prefix is None:
            if ".lora_" not in key:
                yield _engine_name(key), tensor.to(dtype)
            continue
        part = key[len(prefix) :]
        parts = pending.setdefault(prefix, {})
        if part == "base_layer.weight":
            parts["w"] = tensor
        elif part.startswith("lora_A.default."):
            parts["a"] = tensor
        elif part.startswith("lora_B.default."):
            parts["b"] = tensor
        elif ".lora_" not in key:  # a base bias or other base tensor of the layer
            yield _engine_name(key), tensor.to(dtype)
        if parts.keys() >= {"w", "a", "b"}:
            del pending[prefix]
            scale, fan_in_fan_out = scales[prefix]
            delta = (parts["b"].float() @ parts["a"].float()) * scale
            delta = delta.T if fan_in_fan_out else delta
            yield _engine_name(prefix + "base_layer.weight"), (parts["w"].float() + delta).to(dtype)


def engine_buckets(
    sharded: nn.Module,
    world: World,
    *,
    view: WeightView,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[Bucket]:
    """What a rank pushes to its engine after an update, bucket by bucket (module
    docstring): ``view`` "state_dict" the policy's own entries, "merged" the engine's weights
    (a LoRA policy merged in float32), "adapter" the LoRA adapter tensors only (the frozen
    base is never gathered). Every rank calls it with the same arguments."""
    scales = _lora_scales(sharded)
    if view == "adapter":
        tensors = whole_tensors(sharded, world, dtype=dtype, keep=lambda n: ".lora_" in n)
    elif view == "merged" and scales:
        tensors = merged_tensors(whole_tensors(sharded, world, dtype=None), scales, dtype)
    else:
        tensors = whole_tensors(sharded, world, dtype=dtype)
        if view == "merged":
            tensors = ((_engine_name(n), t) for n, t in tensors)
    return bucketed(tensors, bucket_bytes)


def _materialised(
    skeleton: nn.Module, device: torch.device, keep: Callable[[str], bool] | None
) -> nn.Module:
    """An uninitialised copy of ``skeleton`` (meta parameters) on ``device``: the parameters
    ``keep`` names (all when None); the others stay on meta, holding nothing."""

    def convert(name: str, tensor: Tensor) -> Tensor:
        if keep is not None and not keep(name):
            return tensor
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)

    return copy_module(skeleton, convert).requires_grad_(False)


class Mirror:
    """An unsharded module of the policy on this rank, kept equal to the sharded policy by
    :meth:`refresh` (streamed buckets, copied into place one bucket at a time).

    Two uses. The transformers engine generates with a module, so on several ranks it gets
    this one (``eager``: built from the host weights before sharding, on the rank's device).
    Checkpoints need whole weights on rank 0: a ``lazy`` mirror holds only a meta skeleton
    until something asks for :attr:`model`, then it is materialised in host memory. A LoRA
    policy's checkpoint writes its adapters alone, so its lazy mirror ``keep``s the trainable
    parameters only: the frozen base is never gathered and stays on meta (at 7B, 30 GB of
    float32 gathered to rank 0 and held in its host memory for nothing)."""

    def __init__(
        self,
        world: World,
        *,
        model: nn.Module | None = None,
        skeleton: nn.Module | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        keep: Callable[[str], bool] | None = None,
    ) -> None:
        if (model is None) == (skeleton is None):
            raise ValueError("pass model or skeleton")
        self.world = world
        # The state_dict names mirrored (all when None); a name decides, equal on every rank.
        self.keep = keep
        self._model = model
        self._skeleton = skeleton
        self.bucket_bytes = bucket_bytes
        self.lazy = skeleton is not None
        self.fresh = model is not None

    @classmethod
    def copy_of(cls, policy: nn.Module, world: World, device: torch.device) -> Mirror:
        """A copy of the unsharded host ``policy`` on ``device`` (same dtypes), tensor by
        tensor (no second copy on the device first)."""
        return cls(world, model=copy_module(policy, lambda _n, t: t.to(device)))

    @classmethod
    def skeleton_of(cls, policy: nn.Module, world: World) -> Mirror:
        """A meta skeleton of the unsharded ``policy``: no weights held until :attr:`model`;
        of a policy with frozen parameters (LoRA), the trainable ones only ever are."""
        meta = torch.device("meta")
        params = policy.named_parameters(remove_duplicate=False)
        trainable = frozenset(n for n, p in params if p.requires_grad)
        frozen = any(not p.requires_grad for p in policy.parameters())
        keep = trainable.__contains__ if frozen else None
        return cls(world, skeleton=copy_module(policy, lambda _n, t: t.to(meta)), keep=keep)

    @property
    def materialised(self) -> bool:
        return self._model is not None

    @property
    def model(self) -> nn.Module:
        """The unsharded module (a lazy mirror's is made in host memory now, stale)."""
        if self._model is None:
            assert self._skeleton is not None
            self._model = _materialised(self._skeleton, torch.device("cpu"), self.keep)
            self.fresh = False
        return self._model

    def mark_stale(self) -> None:
        """The policy changed (an optimizer step): the next :meth:`ensure_fresh` gathers."""
        self.fresh = False

    def refresh(self, sharded: nn.Module) -> None:
        """Gather ``sharded`` into the mirror, bucket by bucket (every rank calls this)."""
        target = self.model.state_dict()
        tensors = whole_tensors(sharded, self.world, keep=self.keep)
        for bucket in bucketed(tensors, self.bucket_bytes):
            copy_bucket(target, bucket)
        self.fresh = True

    def ensure_fresh(self, sharded: nn.Module) -> None:
        if not self.fresh:
            self.refresh(sharded)

    def gather_for_main(self, sharded: nn.Module) -> None:
        """Whole weights on rank 0 only (a checkpoint's write): rank 0 refreshes its mirror; a
        lazy mirror of another rank runs the same gathers and drops each tensor, never
        materialised. Every rank calls it, and gathers exactly when rank 0 does (``fresh`` moves
        the same way on every rank: :meth:`mark_stale` follows every applied update)."""
        if self.world.is_main or not self.lazy or self._model is not None:
            self.ensure_fresh(sharded)
            return
        if not self.fresh:
            for _ in whole_tensors(sharded, self.world, keep=self.keep):
                pass
            self.fresh = True


def copy_bucket(target: dict[str, Any], bucket: Sequence[tuple[str, Tensor]]) -> None:
    """Copy a bucket's whole tensors into ``target`` (a module's state_dict), casting to each
    target's dtype and device; a name ``target`` lacks is an error (the engine and the policy
    disagree on the model)."""
    with torch.no_grad():
        for name, tensor in bucket:
            if name not in target:
                raise KeyError(f"the module has no weight {name!r}")
            target[name].copy_(tensor.to(target[name].device))
