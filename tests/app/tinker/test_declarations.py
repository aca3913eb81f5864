"""The torch-free declarations the Tinker API admits calls by (the losses and their inputs are
declared once, in jobspec.tinker_losses, which trainer.primitives.losses builds its registry
from): the model limits and the tokenizer get_info names, and GRPO_TINKER_MODEL_ALIASES refused at start when an alias would
shadow a packaged model, is given twice, or has the shape of a saved weights' name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.core.tinker_settings import DEFAULT_SAMPLE_BATCH_TOKENS, TinkerSettings
from app.core.tinker_tables import TinkerModel
from app.tinker.admission import model_limits
from app.tinker.catalog import tokenizer_name
from jobspec import PACKAGED_MODELS


def model(base_model: str, trained_model: str | None = None) -> TinkerModel:
    return TinkerModel(id="s:train:0", base_model=base_model, trained_model=trained_model)


def test_every_packaged_model_has_known_limits_and_a_tokenizer_name() -> None:
    for name in PACKAGED_MODELS:
        limits = model_limits(model(name))
        assert limits is not None and limits.vocab_size > 0 and limits.max_context > 0, name
    assert tokenizer_name(model("smollm2-135m-instruct")) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # An alias of SmolLM2 is SmolLM2's tokenizer; tiny-random-llama's exists only here, so a
    # client resolves it by the name it gave (the cookbook keeps a folder of that name).
    alias = model("Qwen/Qwen3-4B-Instruct-2507", "smollm2-135m-instruct")
    assert tokenizer_name(alias) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tiny_alias = model("meta-llama/Llama-3.2-1B", "tiny-random-llama")
    assert tokenizer_name(tiny_alias) == "meta-llama/Llama-3.2-1B"
    assert tokenizer_name(model("tiny-random-llama")) == "tiny-random-llama"


def test_the_default_sample_budget_is_two_gib_of_smollm2_float32_cache() -> None:
    # 2 x 30 layers x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes a token.
    assert DEFAULT_SAMPLE_BATCH_TOKENS == 2 * 2**30 // 46_080 == 46_603
    assert TinkerSettings().tinker_max_sample_batch_tokens == DEFAULT_SAMPLE_BATCH_TOKENS


@pytest.mark.parametrize(
    ("aliases", "words"),
    [
        ("smollm2-135m-instruct=tiny-random-llama",
         ["'smollm2-135m-instruct=tiny-random-llama'", "shadows the packaged model"]),
        ("Tiny-Random-Llama=smollm2-135m-instruct", ["shadows the packaged model tiny-random-llama"]),
        ("org/m=tiny-random-llama, org/m=smollm2-135m-instruct",
         ["'org/m' is given twice", "'org/m=tiny-random-llama'", "'org/m=smollm2-135m-instruct'"]),
        ("ft:tiny-random-llama:final:s:train:0=tiny-random-llama", ["holds no ':'", "'ft:tiny"]),
        ("tinker://s:train:0/sampler_weights/x=tiny-random-llama", ["holds no ':'", "'tinker://"]),
        ("org/m=not-packaged", ["'org/m=not-packaged'", "PACKAGED one of"]),
    ],
)  # fmt: skip
def test_aliases_are_refused_at_start_naming_the_pair(aliases: str, words: list[str]) -> None:
    with pytest.raises(ValidationError) as refused:
        TinkerSettings(tinker_model_aliases=aliases)
    for word in words:
        assert word in str(refused.value)


def test_aliases_of_their_own_are_kept() -> None:
    settings = TinkerSettings(
        tinker_model_aliases=" meta-llama/Llama-3.2-1B=tiny-random-llama ,"
        "Qwen/Qwen3-4B-Instruct-2507=smollm2-135m-instruct"
    )
    assert settings.tinker_alias_map == {
        "meta-llama/Llama-3.2-1B": "tiny-random-llama",
        "Qwen/Qwen3-4B-Instruct-2507": "smollm2-135m-instruct",
    }
