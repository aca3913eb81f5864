"""Where a checkpoint named by the gateway lies on this host: a job's (a WeightsRef: job id and
folder name) at ``<checkpoint store>/<job_id>/<folder>``, a Tinker sampler save's (a
SamplerWeightsRef) at ``<checkpoint store>/tinker/<project>/<model>/sampler_weights/<name>``:
the layouts the workers write (jobspec.checkpoint_files).

Names only, never paths, cross the wire; still, a name is checked before it touches the disk,
and the folder it reaches after every symlink is followed must stay inside the store (a symlink
planted in a job's folder cannot make this process read, or serve, weights from elsewhere)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from app.gateway.protocol import SamplerWeightsRef, WeightsRef
from app.gateway.served_kinds import LORA, served_name
from jobspec.checkpoint_files import checkpoint_step, job_folder, tinker_save_folder

# Job ids are `job_<hex>` (app.core.ids); any id-like name is accepted, nothing path-like.
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class CheckpointRefused(Exception):
    """The name reaches outside the checkpoint store (by its text or through a symlink)."""


class CheckpointMissing(Exception):
    """No such checkpoint here, or not of the kind asked for (adapters, a full model)."""


def _named_folder(root: Path, ref: WeightsRef | SamplerWeightsRef) -> Path:
    """Where ``ref``'s name puts it under ``root`` (CheckpointRefused for a name that is not
    one: checked again here, whatever the protocol's schema said)."""
    if isinstance(ref, SamplerWeightsRef):
        try:
            return tinker_save_folder(
                root, ref.project_id, ref.model_id, "sampler_weights", ref.name
            )
        except ValueError as exc:
            raise CheckpointRefused(str(exc)) from None
    if not _JOB_ID.match(ref.job_id) or checkpoint_step(ref.folder) is None:
        raise CheckpointRefused(f"not a checkpoint name: {ref.job_id!r} {ref.folder!r}")
    return job_folder(root, ref.job_id) / ref.folder


def checkpoint_folder(store: Path, ref: WeightsRef | SamplerWeightsRef, *, marker: str) -> Path:
    """The real folder of ``ref`` under ``store``, holding ``marker`` (its kind's,
    app.gateway.served_kinds). Raises CheckpointRefused or CheckpointMissing."""
    root = store.resolve()
    named = _named_folder(root, ref)
    try:
        real = named.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a symlink loop
        raise CheckpointMissing(f"no checkpoint {served_name(ref)}") from exc
    if not real.is_relative_to(root) or real == root:
        raise CheckpointRefused(f"checkpoint {served_name(ref)} leads outside the checkpoint store")
    if not real.is_dir() or not (real / marker).is_file():
        raise CheckpointMissing(f"checkpoint {served_name(ref)} has no {marker}")
    for entry in real.iterdir():  # the engine reads these files: none may lead outside
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise CheckpointRefused(f"checkpoint {served_name(ref)} links outside the store")
    return real


def weight_bytes(folder: Path) -> int:
    """The bytes of the safetensors weights in a model folder (what an engine loads)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors") if p.is_file())


def adapter_rank(folder: Path) -> int | None:
    """The largest LoRA rank of the peft adapters in ``folder`` (``r``, or a larger one of its
    ``rank_pattern``), None when its adapter_config.json does not say."""
    try:
        config = json.loads((folder / LORA.marker).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    pattern = config.get("rank_pattern")
    ranks = [config.get("r"), *(pattern.values() if isinstance(pattern, dict) else ())]
    numbers = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    return max(numbers) if numbers else None


def rank_refusal(folder: Path, max_rank: int) -> str | None:
    """Why no engine of this tier can ever load the adapters in ``folder`` (vLLM refuses a rank
    past ``--max-lora-rank``), or None."""
    rank = adapter_rank(folder)
    if rank is None or rank <= max_rank:
        return None
    return (
        f"its LoRA rank is {rank}, larger than the {max_rank} the inference tier serves "
        "(GRPO_INFERENCE_MAX_LORA_RANK)"
    )
