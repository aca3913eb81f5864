"""What the Tinker API tells about models and saves: the server's capabilities, a training
client's info (with a tokenizer name the SDK resolves, never a path of this server), a sampler,
the saves of a training run and a save's weights info."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.errors import NotFound
from app.core.settings import Settings
from app.core.tinker_tables import TinkerCheckpoint, TinkerModel
from app.tinker import repository as repo
from app.tinker.admission import packaged_shape
from app.tinker.names import CHECKPOINT_KINDS
from app.tinker.service import trainable_models, usable_model
from jobspec.model_shape import preset_shape

# The Hugging Face Hub tokenizer of a packaged model, where one has its vocabulary (SmolLM2's
# GGUF, which the packaged model is converted from, holds that tokenizer). tiny-random-llama's
# tokenizer is built here and exists nowhere else.
HUB_TOKENIZERS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def capabilities(settings: Settings) -> dict[str, Any]:
    supported = []
    for name in trainable_models(settings):
        shape = preset_shape(settings.tinker_alias_map.get(name, name))
        context = shape.max_position_embeddings if shape is not None else 0
        supported.append(
            {
                "model_name": name,
                "max_context_length": context or None,
                "trainable": True,
                "sampleable": True,
            }
        )
    return {"supported_models": supported}


def tokenizer_name(model: TinkerModel) -> str:
    """What ``TrainingClient.get_tokenizer`` loads (``AutoTokenizer.from_pretrained``): the
    packaged model's Hub tokenizer, else the model's name as the client gave it (an alias is
    the client's own name; tinker-cookbook's setup keeps a tokenizer folder of that name,
    docs/tinker-cookbook.md). Never a path of this server."""
    return HUB_TOKENIZERS.get(model.model_trained, model.base_model)


def model_info(db: Session, settings: Settings, project_id: str, model_id: str) -> dict[str, Any]:
    model = usable_model(db, settings, project_id, model_id)
    shape = packaged_shape(model)
    return {
        "type": "get_info",
        "model_id": model.id,
        "model_data": {
            "arch": shape.model_type if shape is not None else None,
            "model_name": model.base_model,
            "tokenizer_id": tokenizer_name(model),
        },
        "optimizer_config": {"type": "adamw"},
        "is_lora": True,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


def sampler_info(db: Session, project_id: str, sampler_id: str) -> dict[str, Any]:
    sampler = repo.get_sampler(db, project_id=project_id, sampler_id=sampler_id)
    if sampler is None:
        raise NotFound(f"no sampling session {sampler_id[:120]!r}", param="sampler_id")
    return {
        "sampler_id": sampler.id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return aware.isoformat().replace("+00:00", "Z")


def checkpoint_entry(row: TinkerCheckpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": CHECKPOINT_KINDS.get(row.kind, "training"),
        "time": _iso(row.created_at),
        "tinker_path": f"tinker://{row.model_id}/{row.kind}/{row.name}",
        "size_bytes": row.size_bytes,
        "public": False,
        "user_metadata": row.user_metadata,
        "expires_at": _iso(row.expires_at),
    }


def checkpoints(db: Session, project_id: str, model_id: str) -> dict[str, Any]:
    if repo.get_model(db, project_id=project_id, model_id=model_id) is None:
        raise NotFound(f"no training run {model_id[:120]!r}", param="model_id")
    rows = repo.checkpoints_of_model(db, project_id=project_id, model_id=model_id, now=utcnow())
    return {"checkpoints": [checkpoint_entry(row) for row in rows], "cursor": None}


def delete_checkpoint(db: Session, project_id: str, model_id: str, checkpoint_id: str) -> None:
    """Expire the save ``<kind>/<name>`` of the project's training run now (404 when there is
    none): invisible at once, its folder removed by a worker (worker.maintenance), its bytes
    counted until then."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_KINDS or not repo.expire_checkpoint(
        db, project_id=project_id, model_id=model_id, kind=kind, name=name, now=utcnow()
    ):
        raise NotFound(
            f"no save tinker://{model_id[:120]}/{checkpoint_id[:200]}", param="checkpoint_id"
        )


def weights_info(
    db: Session, project_id: str, model_id: str, kind: str, name: str
) -> dict[str, Any]:
    saved = repo.get_checkpoint(db, project_id=project_id, model_id=model_id, kind=kind, name=name)
    model = repo.get_model(db, project_id=project_id, model_id=model_id)
    if saved is None or model is None:
        raise NotFound(f"no save tinker://{model_id}/{kind}/{name}", param="tinker_path")
    lora = model.lora or {}
    return {
        "base_model": model.base_model,
        "is_lora": True,
        "lora_rank": model.lora_rank,
        "optimizer_config": {"type": "adamw"},
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
    }
