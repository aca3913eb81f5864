"""Which token ids end a completion: every end token the model declares, not only the eos.

A chat model ends its answer with the token its chat template writes after an assistant
message, and that is often not ``tokenizer.eos_token_id``: a Qwen2.5 base tokenizer's eos is
``<|endoftext|>`` while its turns end with ``<|im_end|>``; Llama 3 instruct ends turns with
``<|eot_id|>`` and lists it in ``generation_config.eos_token_id`` next to ``<|end_of_text|>``.
Stopping at the eos alone lets such a model run to ``max_new_tokens`` on every completion (and
then every completion is "truncated", which overlong shaping punishes).

:func:`stop_token_ids` is the one place that decides the set; both rollout engines stop on it
(transformers through ``GenerationConfig.eos_token_id``, vLLM through
``SamplingParams.stop_token_ids``) and cut completions at its first member
(``trainer.rollout.base.completion_from_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

__all__ = [
    "END_OF_TURN_MARKERS",
    "declared_eos_ids",
    "end_of_turn_token_id",
    "stop_token_ids",
]

# End-of-turn tokens of widespread chat formats (ChatML/Qwen/SmolLM, Llama 3, Phi-3 and the
# tiny model, Gemma, Llama 4, Command R). Only a fallback for templates the probe cannot render.
END_OF_TURN_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|eot|>",
    "<|END_OF_TURN_TOKEN|>",
)
# Plain lowercase words: no template rewrites them, and no special token is inside them.
_PROBE = "grpo stop probe"


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    *,
    model: nn.Module | None = None,
    model_path: Path | None = None,
) -> list[int]:
    """Sorted ids that end a completion: the tokenizer's eos, the eos ids the model's generation
    config declares (``model.generation_config``, else the folder's ``generation_config.json``
    or ``config.json``: :func:`declared_eos_ids`), and the chat template's end-of-turn token
    (:func:`end_of_turn_token_id`). ValueError when there is none (generation could never stop).
    """
    ids = set(_ids(tokenizer.eos_token_id))
    ids.update(declared_eos_ids(model=model, model_path=model_path))
    end_of_turn = end_of_turn_token_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    if not ids:
        raise ValueError(
            "the tokenizer has no eos token and the model declares no end token; "
            "generation could never stop"
        )
    return sorted(ids)


def declared_eos_ids(*, model: nn.Module | None = None, model_path: Path | None = None) -> set[int]:
    """The eos ids (an int or a list in Hugging Face configs) the model declares: the model
    object's ``generation_config`` when given, else the folder's ``generation_config.json``,
    else its ``config.json`` (where transformers takes the generation defaults from too)."""
    if model is not None:
        generation = getattr(model, "generation_config", None)
        config = getattr(model, "config", None)
        source = generation if generation is not None else config
        return set(_ids(getattr(source, "eos_token_id", None)))
    if model_path is None:
        return set()
    for name in ("generation_config.json", "config.json"):
        data = _read_json(Path(model_path) / name)
        if data is None:
            continue
        declared = data.get("eos_token_id")
        text_config = data.get("text_config")
        if declared is None and isinstance(text_config, dict):  # multimodal configs nest it
            declared = text_config.get("eos_token_id")
        return set(_ids(declared))
    return set()


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token the chat template closes an assistant turn with, or None (no template, or it
    closes turns with plain text).

    Why this is sound: the template is the model's own definition of the conversation format,
    and a chat model is trained on text rendered with it, so whatever the template writes right
    after an assistant message's content is what the model learnt to emit when its answer is
    done. The probe renders a conversation whose LAST message is the assistant's (so nothing
    that follows can belong to a later turn), finds the probe text, and takes the added token
    (one id, never split, never produced by ordinary text) that starts what follows it,
    whitespace aside. Plain text after the content (a newline) is never taken: stopping on it
    would cut answers short.

    Templates that refuse the probe conversation (some insist on a system message or alternate
    roles strictly) fall back to :data:`END_OF_TURN_MARKERS`: a known marker counts when the
    template's source contains it and the tokenizer holds it as one added token.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    added = _added_tokens(tokenizer)
    if not added:
        return None
    rendered = _render_probe(tokenizer)
    if rendered is not None:
        at = rendered.rfind(_PROBE)
        if at >= 0:
            rest = rendered[at + len(_PROBE) :].lstrip()
            matches = [content for content in added if rest.startswith(content)]
            if matches:
                return added[max(matches, key=len)]
            return None
    sources = template.values() if isinstance(template, dict) else [template]
    for marker in END_OF_TURN_MARKERS:
        if marker in added and any(marker in str(source) for source in sources):
            return added[marker]
    return None


# --------------------------------------------------------------------------- helpers


def _render_probe(tokenizer: PreTrainedTokenizerBase) -> str | None:
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _PROBE},
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template may raise anything (jinja errors, raise_exception)
        return None
    return text if isinstance(text, str) else None


def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Content -> id of the tokenizer's added tokens (special tokens included), non-empty ones."""
    decoder: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = {str(getattr(token, "content", token)): int(i) for i, token in decoder.items()}
    return {content: i for content, i in out.items() if content.strip()}


def _ids(value: object) -> Iterable[int]:
    """An eos declaration (None, an int, or a list of ints) as non-negative ints."""
    if value is None or isinstance(value, bool):
        return []
    values = value if isinstance(value, list | tuple | set) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
