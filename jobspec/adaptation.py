"""The ``lora`` section of the job spec (low-rank adapters) and the training precisions."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from specbase import StrictModel

__all__ = ["ALL_LINEAR", "EMBEDDING_MODULE_NAMES", "LoraSpec", "TrainingDtype"]

# float32: weights, gradients and the update in float32 (as before this option existed).
# bfloat16: mixed precision, the decoder's matmuls in bfloat16 under autocast; float32 master
# weights, gradients and optimizer state; the output head and every log-probability in float32.
TrainingDtype = Literal["float32", "bfloat16"]

# peft's shorthand for "every linear layer except the output head".
ALL_LINEAR: Literal["all-linear"] = "all-linear"
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# Names that are token or position embeddings in the Hugging Face architectures (Llama, Qwen,
# Mistral, Gemma: embed_tokens; GPT-2: wte, wpe; GPT-NeoX: embed_in; BLOOM, Falcon:
# word_embeddings; OPT: embed_positions). An adapter on an embedding is trained but neither the
# engine sync nor a merged export carries it: refused here, before any model is loaded. The
# trainer checks the loaded model too (``trainer.models.lora``), for names this list does not know and
# for a tied output head.
EMBEDDING_MODULE_NAMES = frozenset(
    {"embed_tokens", "wte", "wpe", "embed_in", "word_embeddings", "embed_positions"}
)


class LoraSpec(StrictModel):
    """Train low-rank adapters instead of every weight (LoRA, through peft).

    The reference model for KL is the same base with the adapters switched off (no second copy
    of the weights); checkpoints hold the adapters only; the rollout engine receives the merged
    weights, computed in float32 without touching the base."""

    rank: int = Field(default=16, ge=1, le=1024, description="Rank r of each adapter.")
    alpha: int = Field(
        default=32, ge=1, le=65_536, description="Scale numerator: updates are alpha / r."
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default=ALL_LINEAR,
        description=(
            "Module names to adapt (for example [q_proj, v_proj]), or all-linear: every linear "
            "layer of the decoder, the output head excepted."
        ),
    )

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str):
            return value
        if not 1 <= len(value) <= 64:
            raise ValueError("target_modules lists 1 to 64 module names (or is all-linear)")
        for name in value:
            if not _MODULE_NAME.match(name):
                raise ValueError(
                    f"target_modules entries are module names such as q_proj, got {name!r:.80}"
                )
            if name in EMBEDDING_MODULE_NAMES:
                raise ValueError(
                    f"target_modules entry {name!r} is an embedding: its adapter would be "
                    "trained but never reach the rollout engine or a merged export; adapt the "
                    "decoder's linear layers (all-linear)"
                )
        return value
