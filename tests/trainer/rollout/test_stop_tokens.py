"""Generation ends where the model ends: every end token the model declares stops a completion,
on both engines (the vLLM run is a model run: tests/trainer/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from tests.trainer.conftest import tiny_llama
from tests.trainer.rollout.conftest import (
    CHATML_TEMPLATE,
    chat_prompts,
    qwen_style_tokenizer,
    save_qwen_style_model,
)
from trainer.models.loading import build_tiny_tokenizer
from trainer.rollout.base import completion_from_tokens
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.registry import make_engine
from trainer.rollout.stop_tokens import declared_eos_ids, end_of_turn_token_id, stop_token_ids


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen-style")
    save_qwen_style_model(folder)
    return folder


@pytest.fixture()
def qwen(qwen_dir: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    model = LlamaForCausalLM.from_pretrained(str(qwen_dir)).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    return model, tokenizer


def _id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


# --------------------------------------------------------------------------- which ids


def test_a_qwen_style_tokenizer_ends_turns_with_im_end_not_its_eos() -> None:
    tokenizer = qwen_style_tokenizer()
    im_end, eos = _id(tokenizer, "<|im_end|>"), _id(tokenizer, "<|endoftext|>")
    assert tokenizer.eos_token_id == eos != im_end
    assert end_of_turn_token_id(tokenizer) == im_end
    assert stop_token_ids(tokenizer) == sorted([eos, im_end])


def test_the_tiny_models_end_of_turn_is_its_eos() -> None:
    tokenizer = build_tiny_tokenizer()
    assert end_of_turn_token_id(tokenizer) == tokenizer.eos_token_id
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]


def test_the_generation_configs_eos_list_counts_from_a_model_or_a_folder(tmp_path: Path) -> None:
    # Llama 3 instruct style: generation_config.eos_token_id lists <|eot_id|> beside the eos.
    tokenizer = build_tiny_tokenizer()
    model = tiny_llama(len(tokenizer))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 5, 6]
    assert declared_eos_ids(model=model) == {tokenizer.eos_token_id, 5, 6}
    assert stop_token_ids(tokenizer, model=model) == sorted({tokenizer.eos_token_id, 5, 6})

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 6]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert declared_eos_ids(model_path=tmp_path) == {4, 6}  # the generation config first
    (tmp_path / "generation_config.json").unlink()
    assert declared_eos_ids(model_path=tmp_path) == {1}  # where transformers falls back to
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [2]}}))
    assert declared_eos_ids(model_path=tmp_path) == {2}
    assert declared_eos_ids() == set()


def test_a_template_that_refuses_the_probe_falls_back_to_known_markers() -> None:
    strict = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('the first message must be the system prompt') }}"
        "{% endif %}" + CHATML_TEMPLATE
    )
    tokenizer = qwen_style_tokenizer(strict)
    assert end_of_turn_token_id(tokenizer) == _id(tokenizer, "<|im_end|>")


def test_plain_text_after_an_answer_is_never_a_stop_token() -> None:
    # Turns separated by a blank line only: stopping on "\n" would cut answers short.
    plain = "{% for message in messages %}{{ message['content'] + '\\n\\n' }}{% endfor %}"
    tokenizer = qwen_style_tokenizer(plain)
    assert end_of_turn_token_id(tokenizer) is None
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    tokenizer.chat_template = None
    assert end_of_turn_token_id(tokenizer) is None


def test_no_end_token_at_all_is_refused() -> None:
    tokenizer = qwen_style_tokenizer("{{ messages[0]['content'] }}")
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="could never stop"):
        stop_token_ids(tokenizer)


# --------------------------------------------------------------------------- cutting


def test_completions_are_cut_at_the_first_end_token_of_any_kind() -> None:
    tokenizer = qwen_style_tokenizer()
    im_end, eos = _id(tokenizer, "<|im_end|>"), _id(tokenizer, "<|endoftext|>")
    four, x = _id(tokenizer, "4"), _id(tokenizer, "x")
    stops = [eos, im_end]

    def cut(tokens: list[int], cap: int = 8):  # type: ignore[no-untyped-def]
        logprobs = [-0.1 * (i + 1) for i in range(len(tokens))]
        return completion_from_tokens(
            tokens, logprobs, stop_token_ids=stops, max_new_tokens=cap, tokenizer=tokenizer
        )

    done = cut([four, im_end, x, eos])
    assert done.token_ids == [four, im_end] and done.finish_reason == "stop"
    assert done.logprobs == [-0.1, -0.2] and done.text == "4"
    assert cut([four, eos, im_end]).token_ids == [four, eos]
    long = cut([four, x, x, x], cap=3)
    assert long.token_ids == [four, x, x] and long.finish_reason == "length"
    # An end token past the cap does not count: the completion was truncated.
    assert cut([four, x, im_end], cap=2).finish_reason == "length"


def test_the_end_token_stays_out_of_the_text_even_when_not_special() -> None:
    tokenizer = build_tiny_tokenizer()
    a, b = _id(tokenizer, "a"), _id(tokenizer, "b")
    done = completion_from_tokens(
        [a, b, a], None, stop_token_ids=[b], max_new_tokens=8, tokenizer=tokenizer
    )
    assert done.token_ids == [a, b] and done.text == "a" and done.logprobs is None


# --------------------------------------------------------------------------- engines


def test_transformers_engine_stops_a_qwen_style_model_at_end_of_turn(qwen, qwen_dir: Path) -> None:
    model, tokenizer = qwen
    im_end = _id(tokenizer, "<|im_end|>")
    engine = make_engine(
        "transformers", qwen_dir, tokenizer, dtype="float32", max_model_len=128, policy_model=model
    )
    assert isinstance(engine, HFEngine)
    assert engine.stop_token_ids == sorted([tokenizer.eos_token_id, im_end])
    prompts = chat_prompts(tokenizer, ["what is 2+2?", "hi"])
    for greedy in (False, True):
        groups = engine.generate(
            prompts, 3, max_new_tokens=20, temperature=1.0, seed=0, greedy=greedy
        )
        for group in groups:
            for c in group:
                assert c.token_ids == [_id(tokenizer, "4"), im_end]
                assert c.finish_reason == "stop" and c.text == "4"
                assert c.logprobs is not None and len(c.logprobs) == 2


def test_stopping_at_the_eos_alone_runs_to_max_new_tokens(qwen) -> None:
    # What the engines did before: the same model never samples its eos.
    model, tokenizer = qwen
    engine = HFEngine(
        model,
        tokenizer,
        dtype="float32",
        max_model_len=128,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    (group,) = engine.generate(
        chat_prompts(tokenizer, ["hi"]), 2, max_new_tokens=20, temperature=1.0, seed=0
    )
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for c in group)
    assert group[0].text == "4" + "x" * 18


def test_both_engines_get_the_same_ids_from_a_folder_or_a_model(qwen, qwen_dir: Path) -> None:
    model, tokenizer = qwen
    from_folder = stop_token_ids(tokenizer, model_path=qwen_dir)
    assert from_folder == stop_token_ids(tokenizer, model=model)
    assert from_folder == sorted([tokenizer.eos_token_id, _id(tokenizer, "<|im_end|>")])


def test_vllm_sampling_params_carry_every_end_token(qwen_dir: Path) -> None:
    pytest.importorskip("vllm")
    from trainer.rollout.vllm_engine import sampling_params

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    ids = stop_token_ids(tokenizer, model_path=qwen_dir)
    params = sampling_params(n=2, temperature=1.0, max_new_tokens=20, stop_token_ids=ids)
    assert (
        sorted(params.stop_token_ids or [])
        == ids
        == sorted([tokenizer.eos_token_id, _id(tokenizer, "<|im_end|>")])
    )
    assert params.max_tokens == 20 and params.n == 2


@pytest.fixture(scope="module")
def qwen_vllm(qwen_dir: Path) -> Iterator[object]:
    pytest.importorskip("vllm")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    engine = make_engine(
        "vllm", qwen_dir, tokenizer, dtype="float32", max_model_len=128, kv_cache_bytes=64 << 20
    )
    yield engine
    engine.close()


def test_vllm_engine_stops_a_qwen_style_model_at_end_of_turn(qwen_vllm, qwen_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    im_end = _id(tokenizer, "<|im_end|>")
    assert qwen_vllm.stop_token_ids == sorted([tokenizer.eos_token_id, im_end])
    prompts = chat_prompts(tokenizer, ["what is 2+2?", "hi"])
    for greedy in (False, True):
        groups = qwen_vllm.generate(
            prompts, 3, max_new_tokens=20, temperature=1.0, seed=0, greedy=greedy
        )
        for group in groups:
            for c in group:
                assert c.token_ids == [_id(tokenizer, "4"), im_end]
                assert c.finish_reason == "stop" and c.text == "4"
