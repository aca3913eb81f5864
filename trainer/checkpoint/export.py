"""Turn a checkpoint into a plain Hugging Face model folder (``grpo export DIR --merge``).

A full checkpoint already is one: its model and tokenizer files are copied, the trainer's own
files (optimizer, RNG states, manifest) left behind. A LoRA checkpoint holds adapters only;
without ``merge`` they are copied as a peft adapter folder (``adapter_config.json`` names the
base), with ``merge`` the base is loaded, the adapters merged in float32
(``trainer.models.lora.merged_model``) and the result saved in the base's dtype.

:func:`merge_adapter_folder` does the merge for a plain adapter folder (no trainer state), such
as the one ``grpo download --merge`` receives from the API.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from jobspec.checkpoint_files import MANIFEST, is_model_file
from trainer.checkpoint.durable import write_atomically
from trainer.models.lora import (
    ADAPTER_CONFIG,
    adapter_config,
    merged_model,
    refuse_unsynced_targets,
)

__all__ = ["export_checkpoint", "is_adapter_checkpoint", "merge_adapter_folder"]


def is_adapter_checkpoint(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def export_checkpoint(
    checkpoint: Path, out: Path, *, merge: bool, base: Path | None = None
) -> Path:
    """Write the model of ``checkpoint`` to ``out`` (which must not exist); returns ``out``.

    ``base``: the base model folder of a LoRA checkpoint, when its recorded base (the job's
    ``model``: a packaged name, a Hub id or a folder) cannot be resolved on this machine.
    Written to a temporary sibling then renamed, so ``out`` is complete or absent."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / MANIFEST).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no {MANIFEST})")
    if merge and is_adapter_checkpoint(checkpoint):
        return write_atomically(out, lambda tmp: _merge_into(checkpoint, tmp, base))
    return write_atomically(out, lambda tmp: _copy_model_files(checkpoint, tmp))


def merge_adapter_folder(folder: Path, out: Path, *, base: Path | None = None) -> Path:
    """Merge the peft adapter folder ``folder`` (``adapter_config.json``,
    ``adapter_model.safetensors`` and the tokenizer; trainer state not needed) into its base and
    write the full model to ``out`` (which must not exist); returns ``out``. ``base`` as in
    :func:`export_checkpoint`."""
    folder, out = Path(folder), Path(out)
    if not is_adapter_checkpoint(folder):
        raise ValueError(f"{folder} holds no LoRA adapters (no {ADAPTER_CONFIG}): nothing to merge")
    return write_atomically(out, lambda tmp: _merge_into(folder, tmp, base))


def _copy_model_files(checkpoint: Path, target: Path) -> None:
    for entry in checkpoint.iterdir():
        if entry.is_file() and is_model_file(entry.name):
            shutil.copy2(entry, target / entry.name)


def _merge_into(checkpoint: Path, target: Path, base: Path | None) -> None:
    from peft import PeftModel

    from trainer.models.loading import load_policy, resolve_model

    recorded = str(adapter_config(checkpoint).get("base_model_name_or_path") or "")
    if base is None:
        if not recorded:
            raise ValueError(f"{checkpoint.name} names no base model; pass base=")
        base = resolve_model(recorded)
    model, _ = load_policy(base)
    # An adapter trained elsewhere (or before the job spec refused it) may target a module the
    # merge cannot carry: refused, rather than written without it.
    targets = adapter_config(checkpoint).get("target_modules")
    if isinstance(targets, list):
        refuse_unsynced_targets(model, [str(t) for t in targets])
    lora: Any = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=False)
    merged: Any = merged_model(lora)
    merged.save_pretrained(str(target), safe_serialization=True)
    # The checkpoint's tokenizer: the one the job trained with.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True).save_pretrained(
        str(target)
    )
