"""The kinds of weights the inference tier serves, declared once: the gateway
(app.gateway.service, app.gateway.routing) and `grpo inference` (inference.pool,
inference.checkpoints) both read them. Torch-free.

| kind | what an ensure names | its folder holds | the engine it runs in | the name it answers to |
|---|---|---|---|---|
| base | ``base_model`` alone | config.json (resolved by the trainer's rule) | its own | the engine's key |
| full | ``full``: a full fine-tune's checkpoint | config.json | its own | the engine's key |
| lora | ``adapter``: LoRA adapters | adapter_config.json | its base's | the adapters' served name |

An engine's key (:func:`engine_name`) is also the name it serves its own weights under: a
checkpoint's engine (``full``, or the full checkpoint a LoRA job started from, ``base_weights``)
is keyed by the checkpoint's served name and dtype, a base model's by its name, Hub revision and
dtype (app.gateway.engine_identity.engine_key). A checkpoint's served name is
``<job_id>/<folder>`` (:func:`served_name`; a Tinker sampler save's,
``tinker/<project>/<model id>/<name>@<version>``): the same in every process and after every reload,
distinct for distinct checkpoints. The gateway finds warm weights in a process's state by
comparing these names for equality, never by a part of them (``job_a`` is a part of
``job_ab``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.gateway.engine_identity import engine_key
from app.gateway.protocol import EnsureRequest, SamplerWeightsRef, WeightsRef

ModelKind = Literal["base", "full", "lora"]
MODEL_MARKER = "config.json"  # a model folder (transformers' config)
ADAPTER_MARKER = "adapter_config.json"  # LoRA adapters (peft's config)


@dataclass(frozen=True)
class ServedKind:
    name: ModelKind
    marker: str  # the file its folder holds: a checkpoint without it is not of this kind
    on_base_engine: bool  # loaded into a running engine of its base, not an engine of its own


BASE = ServedKind("base", marker=MODEL_MARKER, on_base_engine=False)
FULL = ServedKind("full", marker=MODEL_MARKER, on_base_engine=False)
LORA = ServedKind("lora", marker=ADAPTER_MARKER, on_base_engine=True)


def kind_of(ensure: EnsureRequest) -> ServedKind:
    """The kind of the weights an ensure asks for."""
    if ensure.adapter is not None:
        return LORA
    return FULL if ensure.full is not None else BASE


def served_name(ref: WeightsRef | SamplerWeightsRef) -> str:
    """The name a checkpoint's adapters, or its engine (in its default dtype), answer to; a
    Tinker sampler save's carries its version, so an overwritten save is loaded anew."""
    if isinstance(ref, SamplerWeightsRef):
        return f"tinker/{ref.project_id}/{ref.model_id}/{ref.name}@{ref.version}"
    return f"{ref.job_id}/{ref.folder}"


def engine_weights(ensure: EnsureRequest) -> WeightsRef | None:
    """The checkpoint the engine of an ensure's weights loads (a full fine-tune's, or the full
    checkpoint under the adapters); None: the engine of the base model."""
    return ensure.full or ensure.base_weights


def engine_name(ensure: EnsureRequest, *, revision: str | None, dtype: str) -> str:
    """The key of the engine an ensure's weights run in, in ``dtype``; a checkpoint holds its
    own weights, so only a base model's engine reads ``revision``."""
    weights = engine_weights(ensure)
    if weights is not None:
        return engine_key(served_name(weights), dtype=dtype)
    return engine_key(ensure.base_model, revision=revision, dtype=dtype)
