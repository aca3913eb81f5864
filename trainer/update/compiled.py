"""``torch.compile`` on the policy's decoder layers: the job setting ``grpo.compile`` and
``python -m bench.gpu_update --compile`` call the one function here.

Each decoder layer's ``forward`` is compiled in place (its class's forward compiled once, the
layer's ``forward`` a method bound to it that calls that with the layer: a deep copy of the
model computes with its own weights): the module stays where it is, with its parameters, names
and ``state_dict`` unchanged, so checkpoints, the engine's weight sync, LoRA's adapter files
and FSDP's units see exactly what they saw without compile, and the module's hooks (FSDP2's
all-gather and reshard) run outside the compiled code, eagerly. The output head (the fused
head's exact float32 forward), the loss and the optimizer stay eager, and so does a forward
with a KV cache (generation by the transformers engine). Compilation happens at a layer's
first call (the first scoring pass or update), again for a new mode or shape (gradients or
not, a layer input that needs a gradient or not, LoRA's adapters off for the reference, a
sequence length before dynamo marks it dynamic), up to :data:`RECOMPILE_LIMIT` variants.

Where it comes in the start-up (``trainer.run.setup``), and why:

1. the policy is loaded, dropout turned off and gradient checkpointing turned on: transformers'
   checkpointing wraps the layer's call, so the checkpoint sits outside the compiled forward
   and its recomputation runs the same compiled code with the forward's RNG state (a LoRA
   dropout's masks match: inductor on CPU gave the same gradients with and without
   checkpointing);
2. LoRA wraps the Linears (peft replaces the modules, which compile must see at its first
   trace) and the frozen base is stored in the training dtype;
3. a full fine-tune's KL reference is copied (it stays eager: scored without gradients, once
   a step) and, on several ranks, the weights are broadcast, the mirror taken (eager) and
   FSDP2 shards each layer (its hooks wrap the compiled forward; a LoRA job on 2 gloo ranks
   trains as without compile, tests/trainer/distributed/test_compiled_ranks.py);
4. then each layer is compiled (:func:`compile_decoder_layers`), before the optimizer.

What cannot work is refused before anything is compiled (:func:`compile_refusal`): a Python or
platform dynamo does not support, inductor on a GPU without triton, inductor on a CPU without a
C++ compiler.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.distributed.sharding import decoder_layers
from trainer.errors import TrainerError

__all__ = [
    "COMPILE_BACKEND",
    "RECOMPILE_LIMIT",
    "CompileNotSupported",
    "compile_decoder_layers",
    "compile_refusal",
    "is_compiled",
]

# torch.compile's default backend: Triton kernels on a GPU, C++ on a CPU. Tests pass a lighter
# one to compile_decoder_layers (inductor's C++ build of a tiny model takes a minute on CPU).
COMPILE_BACKEND = "inductor"
# Variants of one layer's forward a run compiles (dynamo counts them per function, and every
# layer shares its class's forward): scoring or training, a layer input that needs a gradient
# or not (LoRA's first layer), an attention mask or none (a micro-batch without padding),
# LoRA's adapters off for the reference, each first static then dynamic in its sequence
# length. torch's default limit (8) was reached by a LoRA job on two ranks; past it a variant
# runs eagerly, so compile_decoder_layers raises it to this (never lowers it).
RECOMPILE_LIMIT = 64

Backend = str | Callable[..., Any]
_COMPILED = "_grpo_compiled_forward"  # a compiled layer's attribute: its class's compiled forward


class CompileNotSupported(TrainerError):
    """``grpo.compile`` on a machine where torch.compile cannot run; the message says why."""

    reason = "compile_not_supported"


def compile_refusal(device_type: str, backend: Backend | None = None) -> str | None:
    """Why the decoder layers cannot be compiled for a ``device_type`` ("cuda", "cpu") device
    with ``backend`` (default :data:`COMPILE_BACKEND`) on this machine, or None when they can."""
    from torch import _dynamo

    backend = COMPILE_BACKEND if backend is None else backend
    if not _dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python or platform"
    if backend != "inductor":
        return None
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile's inductor backend needs triton on a GPU, and it is not installed"
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # InvalidCxxCompiler, or a missing one raised otherwise
            return f"torch.compile's inductor backend needs a C++ compiler on a CPU: {exc}"
    return None


def compile_decoder_layers(model: nn.Module, backend: Backend | None = None) -> list[nn.Module]:
    """Compile the forward of each decoder layer of ``model`` with ``backend`` (default
    :data:`COMPILE_BACKEND`); returns the layers. One compiled function per layer class takes
    the layer as its first argument, and each layer's ``forward`` becomes a method bound to it
    (:func:`_forward`), so a deep copy of the model (an engine's copy in its own dtype, a merged
    export) computes with its own weights. A call with a KV cache (``past_key_values``: the
    transformers engine's generation) runs the eager forward: its one-token decode steps and
    growing caches would each be a new compilation, using up dynamo's recompile limit before the
    update's passes compile; that limit is raised to :data:`RECOMPILE_LIMIT` for the process.
    Nothing is traced until a layer's first call. ``model`` as the module docstring's order
    leaves it."""
    from torch._dynamo import config

    layers = decoder_layers(model)
    if not layers:
        raise CompileNotSupported(f"{type(model).__name__} has no decoder layers to compile")
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    by_forward: dict[Callable[..., Any], Callable[..., Any]] = {}
    for layer in layers:
        if is_compiled(layer):
            continue
        forward = type(layer).forward
        if forward not in by_forward:
            by_forward[forward] = torch.compile(
                forward, backend=COMPILE_BACKEND if backend is None else backend
            )
        setattr(layer, _COMPILED, by_forward[forward])
        layer.forward = types.MethodType(_forward, layer)  # type: ignore[method-assign]
    return layers


def _forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A compiled layer's forward: its class's compiled forward for the scoring and training
    passes, the eager one when it is given a KV cache."""
    if kwargs.get("past_key_values") is not None:
        return type(layer).forward(layer, *args, **kwargs)
    return getattr(layer, _COMPILED)(layer, *args, **kwargs)


def is_compiled(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward was compiled by :func:`compile_decoder_layers`."""
    forward = layer.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _forward
