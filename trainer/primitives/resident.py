"""What a saved state leaves out of a resident model, so that a model written to disk and
read back continues exactly as if it had stayed in memory (the service releases an idle
training client's worker this way and loads it again on its next call).

A state folder (``trainer.primitives.state``) holds the adapter, Adam's state and the step
count: enough to continue between steps. A resident model also holds

- the gradients accumulated since the last ``optim_step`` (a client may go idle between
  ``forward_backward`` and ``optim_step``): ``gradients.safetensors``, by parameter name;
- sampler weights kept in memory (snapshots taken by ``save_weights_for_sampler``, sampled
  later): ``snapshots.safetensors``, each tensor keyed ``<index>/<parameter name>``, with
  ``snapshots.json`` listing the snapshots' keys in order (index = position).

safetensors stores the bits as they are: what is read back equals what was written.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from trainer.primitives.adapters import WeightsSnapshot
from trainer.primitives.types import PrimitiveError

__all__ = ["read_resident_extras", "write_resident_extras"]

GRADIENTS_FILE = "gradients.safetensors"
SNAPSHOTS_FILE = "snapshots.safetensors"
SNAPSHOT_KEYS_FILE = "snapshots.json"


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def write_resident_extras(
    folder: Path, model: nn.Module, snapshots: Mapping[str, WeightsSnapshot]
) -> None:
    """The model's accumulated gradients and ``snapshots`` (in their order) into ``folder``."""
    gradients = {
        name: p.grad.detach().contiguous().cpu()
        for name, p in _trainable(model).items()
        if p.grad is not None
    }
    save_file(gradients, str(folder / GRADIENTS_FILE))
    keys = list(snapshots)
    tensors: dict[str, Tensor] = {}
    for index, key in enumerate(keys):
        for name, value in snapshots[key].tensors.items():
            tensors[f"{index}/{name}"] = value.detach().contiguous().cpu()
    save_file(tensors, str(folder / SNAPSHOTS_FILE))
    (folder / SNAPSHOT_KEYS_FILE).write_text(json.dumps(keys))


def read_resident_extras(folder: Path, model: nn.Module) -> OrderedDict[str, WeightsSnapshot]:
    """Put the gradients saved in ``folder`` back on ``model``'s parameters (none saved: none
    accumulated) and return the saved snapshots, in order. PrimitiveError when the files are
    missing or do not fit the model."""
    params = _trainable(model)
    try:
        gradients = load_file(str(folder / GRADIENTS_FILE))
        stored = load_file(str(folder / SNAPSHOTS_FILE))
        keys = json.loads((folder / SNAPSHOT_KEYS_FILE).read_text())
    except (OSError, SafetensorError, ValueError) as exc:
        raise PrimitiveError(f"path: not a resident model's folder: {exc}") from None
    if not set(gradients) <= set(params):
        raise PrimitiveError("path: the saved gradients are not this model's parameters")
    for name, grad in gradients.items():
        param = params[name]
        if grad.shape != param.shape:
            raise PrimitiveError(f"path: the saved gradient of {name} does not fit the model")
        param.grad = grad.to(device=param.device, dtype=param.dtype)
    snapshots: OrderedDict[str, WeightsSnapshot] = OrderedDict()
    for index, key in enumerate(keys):
        prefix = f"{index}/"
        tensors = {
            name[len(prefix) :]: value.to(device=params[name[len(prefix) :]].device)
            for name, value in stored.items()
            if name.startswith(prefix) and name[len(prefix) :] in params
        }
        if set(tensors) != set(params):
            raise PrimitiveError(f"path: saved sampler weights {key!r} do not fit the model")
        snapshots[str(key)] = WeightsSnapshot(tensors)
    return snapshots
