"""Published weight versions: the files through which a rollout server's client hands it
weights (:mod:`trainer.rollout.remote_engine` writes them, :mod:`trainer.rollout.rollout_server`
reads them), so that publishing never waits for the server, which may be generating.

Version ``v`` is the folder ``<versions>/v<v>``, written into a new folder and renamed into
place whole, so a server never reads half a version: :data:`MANIFEST` (``kind`` "merged" or
"adapter", ``files`` in order), one safetensors file per bucket (the tensors and names the
in-process engines get: merged weights under their Hugging Face names, or a LoRA adapter's
tensors under the policy's state_dict names), and for an adapter its ``adapter_config.json``.
A version's files never change once written: versions only grow.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.models.lora import is_lora
from trainer.rollout.vllm_weights import engine_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MANIFEST",
    "PublishedVersions",
    "adapter_config",
    "policy_tensors",
    "published_buckets",
    "version_folder",
]

MANIFEST = "manifest.json"
DEFAULT_BUCKET_BYTES = 64 << 20  # what one file holds (the trainer's copies at once)


def version_folder(weights_dir: Path, version: int) -> Path:
    """Where the published files of ``version`` live."""
    return weights_dir / f"v{version}"


def policy_tensors(
    model: nn.Module, dtype: torch.dtype, *, adapters: bool
) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
    """What a sync publishes of ``model``, one tensor at a time, in ``dtype``, and the peft
    config that goes with it: the engine's weights (a LoRA model merged in float32,
    :func:`trainer.rollout.vllm_weights.engine_tensors`) and None, or with ``adapters`` the
    LoRA adapter's tensors and its config (the engine keeps its base weights)."""
    if not adapters:
        return engine_tensors(model, dtype), None
    if not is_lora(model):
        raise ValueError("an adapter engine publishes a LoRA model's adapter")
    tensors = (
        (name, tensor.detach().to(dtype))
        for name, tensor in model.state_dict().items()
        if ".lora_" in name
    )
    return tensors, getattr(model, "peft_config")["default"]  # noqa: B009 - a PeftModel


class PublishedVersions:
    """The weight versions a client published, as files in ``folder`` (module docstring).
    The model folder's weights are ``base_version`` (None: no version) until forgotten.

    Thread-safe: one thread publishes while others resolve versions for their calls."""

    def __init__(
        self, folder: Path, *, base_version: int | None, adapters: bool, publish_version: int
    ) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.base_version = base_version
        self.adapters = adapters
        self.publish_version = publish_version
        self._published: set[int] = set()
        self._newest: int | None = None  # the highest version ever published
        self._oldest_kept = base_version if base_version is not None else 0
        self._state = threading.Lock()  # the sets above
        self._publishing = threading.Lock()  # one publish at a time

    def resolve(self, version: int | None) -> int:
        """The version a call gets: ``version`` when published (or the base, kept), None:
        the newest published, else the base. ValueError for any other."""
        with self._state:
            if version is None and self._published:
                return max(self._published)
            if version is not None and version in self._published:
                return version
            base_kept = self.base_version is not None and self.base_version >= self._oldest_kept
        if base_kept and version in (None, self.base_version):
            return self.base_version  # type: ignore[return-value]
        if version is None:
            raise ValueError("no version is published and the folder's weights are no version")
        raise ValueError(f"version {version} is not published (or was forgotten)")

    def publish(
        self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], adapter_config: Any
    ) -> int:
        """Write the buckets (one safetensors file each, in order; an adapter's peft config
        beside them) as :attr:`publish_version`, which then moves one up; returns the
        version. Versions must grow: a server holding a version never reloads it."""
        if (adapter_config is not None) != self.adapters:
            raise ValueError(
                "an adapter engine publishes adapters with their config, any other merged weights"
            )
        with self._publishing:
            version = self.publish_version
            if self._newest is not None and version <= self._newest:
                raise ValueError(f"version {version} is not above {self._newest}, published")
            tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.folder))
            try:
                files = _write_buckets(tmp, buckets)
                if adapter_config is not None:
                    adapter_config.save_pretrained(str(tmp))
                kind = "adapter" if adapter_config is not None else "merged"
                (tmp / MANIFEST).write_text(json.dumps({"kind": kind, "files": files}))
                os.rename(tmp, version_folder(self.folder, version))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with self._state:
                self._published.add(version)
                self._newest = version
            self.publish_version = version + 1
            return version

    def forget_below(self, version: int) -> None:
        """Delete every published version below ``version``; calls naming one of them (or
        the base below it) are refused from now on. Only versions no call still needs: a
        server loading one as it goes would fail that call."""
        with self._state:
            gone = sorted(v for v in self._published if v < version)
            self._published.difference_update(gone)
            self._oldest_kept = max(self._oldest_kept, version)
        for old in gone:
            shutil.rmtree(version_folder(self.folder, old), ignore_errors=True)


def _write_buckets(
    folder: Path, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]
) -> list[str]:
    """Each bucket to its own safetensors file, in order; returns the file names."""
    files = []
    for index, bucket in enumerate(buckets):
        name = f"bucket-{index:05d}.safetensors"
        save_file(_unshared(bucket), str(folder / name))
        files.append(name)
    if not files:
        raise ValueError("no weights were given to publish")
    return files


def _unshared(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A bucket as safetensors takes it: on the CPU, contiguous, and no two tensors sharing
    memory (a tied head and its embedding are the same tensor in a state_dict)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in bucket:
        cpu = tensor.detach().to("cpu").contiguous()
        storage = cpu.untyped_storage()
        whole = storage.nbytes() == cpu.numel() * cpu.element_size()
        if storage.data_ptr() in seen or not whole:
            cpu = cpu.clone()
        seen.add(cpu.untyped_storage().data_ptr())
        out[name] = cpu
    return out


def published_buckets(folder: Path) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A published version's tensors, one file (bucket) at a time, in the order written."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in manifest["files"]:
        yield list(load_file(str(folder / name)).items())


def adapter_config(folder: Path) -> Any:
    """The peft config of a published adapter version, None for merged weights."""
    if json.loads((folder / MANIFEST).read_text())["kind"] != "adapter":
        return None
    from peft import LoraConfig

    return LoraConfig.from_pretrained(str(folder))
