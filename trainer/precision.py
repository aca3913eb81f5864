"""Training precision: float32, or bfloat16 mixed precision.

bfloat16 here means autocast: the decoder's matmuls run in bfloat16 while the parameters,
their gradients and AdamW's state stay float32 (master weights), so small updates are not lost
to bfloat16's 8-bit mantissa. Two places stay float32 on purpose: the output head and its
log-softmax (``trainer.logprobs`` runs them outside autocast: a bfloat16 logit of size 20 is off
by up to 0.06, as much as a whole clip range of ratio), and everything computed from
log-probabilities (ratios, KL, losses). The KL reference is frozen, so it needs no master
copy: it is kept in bfloat16 (half the memory of a float32 copy), its output head float32.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from trainer.config import TrainingDtype

__all__ = ["autocast", "enable_tf32", "frozen_reference", "torch_dtype_of"]

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


def frozen_reference(model: nn.Module, name: TrainingDtype) -> nn.Module:
    """A frozen copy of ``model`` for the KL reference, in the training dtype: bfloat16 weights
    for bfloat16 training, its output head (and, when tied, the embeddings) kept float32 so
    that reference log-probabilities are as exact as the policy's."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)  # a caller's model may carry gradients
    ref.eval().requires_grad_(False)
    if name == "float32":
        return ref
    ref.to(torch_dtype_of(name))
    get_head = getattr(ref, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        head.float()
    return ref
