"""What the Tinker API refuses before it stores a call (app.tinker.admission), over HTTP without
a worker, on Postgres and on the embedded SQLite: token ids outside the model's vocabulary,
sequences beyond its context, loss names and loss_fn_inputs keys the loss does not take, a
sample batch over GRPO_TINKER_MAX_SAMPLE_BATCH_TOKENS, degenerate sampling parameters and JSON
a json column cannot store. Each is a 400 naming the field (``param`` too) and stores nothing;
and get_info names a tokenizer, never a path of the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest
from app.main import create_app
from app.tinker.wire import FwdBwdRequest, WireDatum, encode_forward_backward
from tests.app.tinker.test_tinker_api import Tinker, edit

TINY_VOCAB, TINY_CONTEXT = 57, 1024  # tiny-random-llama's (jobspec.model_shape)
SAMPLE_BUDGET = 100


@pytest.fixture
def tinker(settings: Settings) -> Iterator[Tinker]:
    tuned = settings.model_copy(
        update={"tinker_max_body_bytes": 100_000, "tinker_max_sample_batch_tokens": SAMPLE_BUDGET}
    )
    with TestClient(create_app(tuned)) as client:
        yield Tinker(client, tuned)


def stored_calls(settings: Settings, model_id: str) -> int:
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            count = select(func.count()).where(TinkerRequest.model_id == model_id)
            return int(db.scalar(count) or 0)
    finally:
        engine.dispose()


def next_token_datum(tokens: list[int], **inputs: list[Any]) -> WireDatum:
    return WireDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:], **inputs})


def fwdbwd(tinker: Tinker, model_id: str, loss_fn: str, *data: WireDatum, **config: Any) -> Any:
    body = encode_forward_backward(
        FwdBwdRequest(model_id, 1, loss_fn, False, dict(config), list(data))
    )
    return tinker.client.post(
        "/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": tinker.key, "Content-Type": "application/x-protobuf"},
    )


def refused(answer: Any, param: str, *words: str) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize(
    ("loss_fn", "datum", "config", "param", "words"),
    [
        ("cross_entropy", next_token_datum([1, TINY_VOCAB, 3]), {}, "data[0].model_input[1]",
         ["57", "outside the vocabulary (0 to 56)"]),
        ("cross_entropy", next_token_datum([1, 2, TINY_VOCAB + 5]), {},
         "data[0].loss_fn_inputs.target_tokens[1]", ["62", "outside the vocabulary"]),
        ("cross_entropy", next_token_datum([1] * (TINY_CONTEXT + 2)), {}, "data[0].model_input",
         ["1025 tokens", "context of 1024"]),
        ("cross_entropy", next_token_datum([1, 2, 3], advantages=[1.0, 1.0]), {},
         "data[0].loss_fn_inputs.advantages", ["not an input of cross_entropy"]),
        ("importance_sampling", next_token_datum([1, 2, 3], logprobs=[0.0, 0.0]), {},
         "data[0].loss_fn_inputs.advantages", ["missing", "target_tokens, logprobs, advantages"]),
        ("no_such_loss", next_token_datum([1, 2, 3]), {}, "loss_fn",
         ["no_such_loss", "cross_entropy, importance_sampling, ppo, cispo, dro, gspo"]),
        ("stable_reinforce", next_token_datum([1, 2, 3]), {}, "loss_fn", ["not supported"]),
        ("cross_entropy", next_token_datum([1, 2, 3]), {"beta": 0.1}, "loss_fn_config.beta",
         ["not a config key of cross_entropy"]),
        ("dro", next_token_datum([1, 2, 3], logprobs=[0.0, 0.0], advantages=[1.0, 1.0]),
         {"beta": "high"}, "loss_fn_config.beta", ["expected a number"]),
        ("cross_entropy", next_token_datum([1, 2, 3], weights=[1.0, float("nan")]), {},
         "data[0].loss_fn_inputs.weights[1]", ["not a finite number"]),
        ("cross_entropy", next_token_datum([1, 2, 3], target_tokens=[2.0, 3.0]), {},
         "data[0].loss_fn_inputs.target_tokens", ["integer token ids"]),
    ],
)  # fmt: skip
def test_a_training_call_the_worker_would_refuse_is_a_400_and_is_not_stored(
    tinker: Tinker,
    loss_fn: str,
    datum: WireDatum,
    config: dict[str, Any],
    param: str,
    words: list[str],
) -> None:
    model_id = tinker.model(tinker.session())
    refused(fwdbwd(tinker, model_id, loss_fn, datum, **config), param, *words)
    assert stored_calls(tinker.settings, model_id) == 1  # create_model's alone
    # The seq_id was not used: the corrected call takes it.
    good = fwdbwd(tinker, model_id, "cross_entropy", next_token_datum([1, 2, TINY_VOCAB - 1]))
    assert good.status_code == 200, good.text
    assert stored_calls(tinker.settings, model_id) == 2


def test_a_policy_loss_call_with_its_inputs_is_accepted(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    datum = next_token_datum(
        [1, 2, 3, 4],
        logprobs=[0.0, -1.0, -2.0],
        advantages=[0.0, 1.0, -1.0],
        clip_low_threshold=[0.9] * 3,
    )
    answer = fwdbwd(tinker, model_id, "ppo", datum, clip_high_threshold=1.3)
    assert answer.status_code == 200, answer.text


def sampler(tinker: Tinker) -> str:
    made = tinker.post(
        "create_sampling_session",
        {"session_id": tinker.session(), "sampling_session_seq_id": 0,
         "base_model": "tiny-random-llama"},
    )  # fmt: skip
    assert made.status_code == 200, made.text
    return str(made.json()["sampling_session_id"])


def sample(tinker: Tinker, sampler_id: str, tokens: list[int], **fields: Any) -> Any:
    params = {"max_tokens": 4, **fields.pop("sampling_params", {})}
    body = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": params, **fields}  # fmt: skip
    return tinker.post("asample", body)


def sampler_calls(tinker: Tinker, sampler_id: str) -> int:
    return stored_calls(tinker.settings, sampler_id.replace(":sample:", ":base:"))


@pytest.mark.parametrize(
    ("tokens", "fields", "param", "words"),
    [
        ([1, TINY_VOCAB + 1], {}, "prompt[1]", ["58", "outside the vocabulary (0 to 56)"]),
        ([1] * 1000, {"sampling_params": {"max_tokens": 30}}, "sampling_params.max_tokens",
         ["1000 prompt tokens + 30", "context of 1024"]),
        ([1, 2, 3], {"num_samples": 8, "sampling_params": {"max_tokens": 20}}, "num_samples",
         ["8 samples x (3 prompt tokens + 20 max_tokens) = 184 tokens", f"{SAMPLE_BUDGET}",
          "GRPO_TINKER_MAX_SAMPLE_BATCH_TOKENS"]),
        ([1, 2, 3], {"sampling_params": {"temperature": 1e-300}}, "sampling_params.temperature",
         ["degenerate", "0 (greedy decoding) or at least 0.001"]),
        ([1, 2, 3], {"sampling_params": {"temperature": -1}}, "sampling_params.temperature", []),
        ([1, 2, 3], {"sampling_params": {"top_p": 1e-300}}, "sampling_params.top_p",
         ["outside [0.001, 1]"]),
        ([1, 2, 3], {"sampling_params": {"top_p": 0}}, "sampling_params.top_p", []),
    ],
)  # fmt: skip
def test_a_sample_call_the_worker_would_refuse_is_a_400_and_is_not_stored(
    tinker: Tinker, tokens: list[int], fields: dict[str, Any], param: str, words: list[str]
) -> None:
    sampler_id = sampler(tinker)
    refused(sample(tinker, sampler_id, tokens, **fields), param, *words)
    assert sampler_calls(tinker, sampler_id) == 1  # the sampler model's create_model alone


def test_a_sample_call_within_the_bounds_is_accepted(tinker: Tinker) -> None:
    sampler_id = sampler(tinker)
    # 4 x (3 + 22) = 100 tokens: exactly the budget; temperature 0 is greedy decoding.
    greedy = sample(tinker, sampler_id, [1, 2, TINY_VOCAB - 1], num_samples=4,
                    sampling_params={"max_tokens": 22, "temperature": 0, "top_p": 0.001})  # fmt: skip
    assert greedy.status_code == 200, greedy.text
    assert sampler_calls(tinker, sampler_id) == 2


def test_an_image_prompt_is_a_400_in_the_api(tinker: Tinker) -> None:
    sampler_id = sampler(tinker)
    body = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "image", "data": "iVBORw0K", "format": "png"}]},
            "sampling_params": {"max_tokens": 4}}  # fmt: skip
    refused(tinker.post("asample", body), "prompt.chunks[0]", "image chunks are not supported")


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        (b'{"lr": NaN}', ["lr: nan is not a JSON number"]),
        (b'{"run": {"scores": [1, Infinity]}}', ["run.scores[1]: inf"]),
        (b'{"floor": -Infinity}', ["floor: -inf"]),
        (b'{"huge": 1e400}', ["huge: inf", "1.8e308"]),
        (b'{"deep": ' + b"[" * 17 + b"]" * 17 + b"}", ["nested deeper than 16 levels"]),
    ],
)
def test_json_a_json_column_cannot_store_is_a_400_naming_the_field(
    tinker: Tinker, metadata: bytes, words: list[str]
) -> None:
    body = b'{"tags": [], "sdk_version": "0.38.0", "user_metadata": ' + metadata + b"}"
    answer = tinker.client.post(
        "/api/v1/create_session",
        content=body,
        headers={"X-API-Key": tinker.key, "Content-Type": "application/json"},
    )
    refused(answer, "user_metadata", *words)
    session_id = tinker.session()
    model = (
        b'{"session_id": "%s", "model_seq_id": 0, "base_model": "tiny-random-llama", '
        b'"lora_config": {"rank": 4}, "user_metadata": ' % session_id.encode() + metadata + b"}"
    )
    answer = tinker.client.post(
        "/api/v1/create_model",
        content=model,
        headers={"X-API-Key": tinker.key, "Content-Type": "application/json"},
    )
    refused(answer, "user_metadata", *words)


def test_get_info_names_a_tokenizer_never_a_server_path(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    edit(tinker.settings, TinkerModel, model_id, model_folder="/srv/grpo/models/tiny-v1")
    answer = tinker.post("get_info", {"model_id": model_id})
    assert answer.status_code == 200, answer.text
    assert "/srv/grpo" not in answer.text
    info = answer.json()
    assert info["model_data"] == {
        "arch": "llama",
        "model_name": "tiny-random-llama",
        "tokenizer_id": "tiny-random-llama",  # built here: the name the client gave
    }
    assert info["model_name"] == "tiny-random-llama" and info["lora_rank"] == 4
    capabilities = tinker.client.get(
        "/api/v1/get_server_capabilities", headers={"X-API-Key": tinker.key}
    ).json()
    (tiny,) = [
        m for m in capabilities["supported_models"] if m["model_name"] == "tiny-random-llama"
    ]
    assert tiny["max_context_length"] == TINY_CONTEXT
