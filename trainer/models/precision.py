"""Training precision: float32, or bfloat16 mixed precision.

bfloat16 here means autocast: the decoder's matmuls run in bfloat16 while the parameters,
their gradients and AdamW's state stay float32 (master weights), so small updates are not lost
to bfloat16's 8-bit mantissa. Two places stay float32 on purpose: the output head and its
log-softmax (``trainer.update.logprobs`` runs them outside autocast: a bfloat16 logit of size 20 is off
by up to 0.06, as much as a whole clip range of ratio), and everything computed from
log-probabilities (ratios, KL, losses). The KL reference is frozen, so it needs no master
copy: its decoder Linear weights are kept in bfloat16 (what autocast computes with anyway),
the rest float32, so that it equals the policy exactly before the first update.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from jobspec import TrainingDtype

__all__ = [
    "autocast",
    "copy_module",
    "enable_tf32",
    "exact_float32_matmuls",
    "frozen_reference",
    "store_frozen_linears_for_autocast",
    "torch_dtype_of",
]

_DTYPES: dict[TrainingDtype, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


def torch_dtype_of(name: TrainingDtype) -> torch.dtype:
    return _DTYPES[name]


def autocast(name: TrainingDtype, device: torch.device) -> Any:
    """The context a training or scoring forward pass runs in: bfloat16 autocast on the
    device's type, or nothing for float32."""
    if name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype_of(name))


def enable_tf32(device: torch.device) -> bool:
    """Let float32 matmuls use TF32 tensor cores where the device has them (CUDA, Ampere and
    later); a no-op elsewhere. Returns whether it is on."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, _minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


@contextlib.contextmanager
def exact_float32_matmuls() -> Iterator[None]:
    """Float32 matmuls at full precision inside this scope, whatever :func:`enable_tf32` set
    for the process; the setting is put back on exit.

    For the output head: TF32 rounds each input to 10 mantissa bits (relative error about
    5e-4), so a logit of size 20 moves by about 0.01, the size of error the head is kept
    float32 to avoid. Through ``torch.set_float32_matmul_precision``, which reads and writes the same
    switch as ``torch.backends.cuda.matmul.allow_tf32``: mixing that one with the newer
    ``fp32_precision`` switches is an error in torch."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def copy_module(model: nn.Module, convert: Callable[[str, Tensor], Tensor]) -> nn.Module:
    """A copy of ``model``'s structure whose parameters are ``convert(name, parameter)``
    (frozen), built one tensor at a time: never a whole second copy in the source dtype first.

    ``copy.deepcopy`` with a memo that maps each parameter to its converted one copies
    everything else (buffers, config, hooks) as deepcopy does. Tied parameters are one object,
    so they stay tied (converted once, under the first name)."""
    memo: dict[int, Any] = {}
    for name, param in model.named_parameters():
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(convert(name, param.detach()), requires_grad=False)
    copied = copy.deepcopy(model, memo)
    copied.eval().requires_grad_(False)
    return copied


def _autocast_weight_names(model: nn.Module) -> set[str]:
    """Names of the parameters autocast computes with in bfloat16: those of ``nn.Linear``
    layers other than the output head, and of no other module (a tied weight stays float32)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linear: dict[int, str] = {}
    elsewhere: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.Linear) and module is not head:
                linear.setdefault(id(param), f"{module_name}.{param_name}".lstrip("."))
            else:
                elsewhere.add(id(param))
    return {name for key, name in linear.items() if key not in elsewhere}


def frozen_reference(model: nn.Module, name: TrainingDtype) -> nn.Module:
    """A frozen copy of ``model`` for the KL reference that computes exactly what the policy
    computes under the same :func:`autocast`, built tensor by tensor (:func:`copy_module`):
    call it on the host weights before the policy goes to the device, and the device never
    holds a second float32 copy of the policy (docs/scaling.md, start-up order).

    float32 training: a plain copy. bfloat16 training: only the weights autocast would cast
    anyway are stored in bfloat16, those of the ``nn.Linear`` layers other than the output
    head (autocast runs ``linear`` in bfloat16, and rounding a float32 weight once here gives
    the very values autocast's own cast gives). Everything autocast leaves in float32 stays
    float32: embeddings, norms, the rotary frequencies, the output head (a whole-model bfloat16
    copy rounded those too, and the reference differed from the policy by 0.026 nat a token
    before any update). Most of a decoder's weights are in those Linear layers, so the copy is
    still about half the memory of a float32 one."""
    if name == "float32":
        return copy_module(model, lambda _name, tensor: tensor.clone())
    dtype = torch_dtype_of(name)
    cast = _autocast_weight_names(model)

    def convert(param_name: str, tensor: Tensor) -> Tensor:
        return tensor.to(dtype) if param_name in cast else tensor.clone()

    return copy_module(model, convert)


def store_frozen_linears_for_autocast(model: nn.Module, name: TrainingDtype) -> int:
    """Store ``model``'s frozen weights that :func:`autocast` computes with in its dtype, in
    place (a LoRA job's base under bfloat16 training); the bytes saved. Exact, for the reason
    :func:`frozen_reference` gives: autocast casts those ``nn.Linear`` weights to bfloat16 at
    every use, and rounding once here gives the same values; they never train, so no master
    copy is lost. Embeddings, norms and the output head stay float32. A 14B LoRA job's base
    halves (about 59 to 31 GB), which is what lets it fit one 80 GB device."""
    if name == "float32":
        return 0
    dtype = torch_dtype_of(name)
    cast = _autocast_weight_names(model)
    saved = 0
    for param_name, param in model.named_parameters():
        if param_name in cast and not param.requires_grad and param.dtype != dtype:
            saved += param.numel() * (param.element_size() - dtype.itemsize)
            param.data = param.data.to(dtype)
    return saved
