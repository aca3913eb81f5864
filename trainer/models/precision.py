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
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from jobspec import TrainingDtype

__all__ = [
    "autocast",
    "enable_tf32",
    "exact_float32_matmuls",
    "frozen_reference",
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


def frozen_reference(model: nn.Module, name: TrainingDtype) -> nn.Module:
    """A frozen copy of ``model`` for the KL reference that computes exactly what the policy
    computes under the same :func:`autocast`.

    float32 training: a plain copy. bfloat16 training: only the weights autocast would cast
    anyway are stored in bfloat16, those of the ``nn.Linear`` layers other than the output
    head (autocast runs ``linear`` in bfloat16, and rounding a float32 weight once here gives
    the very values autocast's own cast gives). Everything autocast leaves in float32 stays
    float32: embeddings, norms, the rotary frequencies, the output head (a whole-model bfloat16
    copy rounded those too, and the reference differed from the policy by 0.026 nat a token
    before any update). Most of a decoder's weights are in those Linear layers, so the copy is
    still about half the memory of a float32 one."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)  # a caller's model may carry gradients
    ref.eval().requires_grad_(False)
    if name == "float32":
        return ref
    get_head = getattr(ref, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    dtype = torch_dtype_of(name)
    for module in ref.modules():
        if isinstance(module, nn.Linear) and module is not head:
            module.to(dtype)
    return ref
