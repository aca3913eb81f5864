"""A tracking allocator for CPU tests: the live bytes of every storage an op creates, and their
peak, per dtype, seen through a TorchDispatchMode.

On a machine without a GPU the training device and the host are the same memory, so a test
that bounds what is live in total bounds what the device would hold (a stronger statement).
Storages are keyed by their StorageImpl and counted until it is freed (StorageWeakRef), so an
alias (a view, ``param.data``, a ``Parameter`` around a tensor) is counted once."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Counts the storages of ``dtype`` (None: any) created by ops inside the mode, plus those
    of the tensors given to :meth:`adopt` (allocated before it), and their peak."""

    def __init__(self, dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def adopt(self, tensors: Any) -> None:
        for tensor in tensors:
            self._track(tensor)
        self._update()

    def live(self) -> int:
        return sum(n for ref, n in self._live.values() if not ref.expired())

    def _track(self, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if self.dtype is not None and tensor.dtype != self.dtype:
            return
        if tensor.device.type == "meta":
            return
        inner = getattr(tensor, "_local_tensor", None)  # a DTensor: its local shard
        storage = (inner if inner is not None else tensor).untyped_storage()
        ref = StorageWeakRef(storage)
        known = self._live.get(ref.cdata)
        if known is None or known[0].expired():
            self._live[ref.cdata] = (ref, storage.nbytes())

    def _update(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.peak = max(self.peak, self.live())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self._track(tensor)
        self._update()
        return out


def float32_bytes(model: torch.nn.Module) -> int:
    """The float32 parameter bytes of an unsharded model (tied weights once)."""
    return sum(p.numel() * 4 for p in model.parameters() if p.dtype == torch.float32)
