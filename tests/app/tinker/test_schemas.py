"""app.tinker.schemas, schema_parts and names: requests take what newer SDKs add and nothing
unbounded, replies hold what the SDK requires, and ids and tinker:// paths keep their grammar."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.tinker import names, schemas
from app.tinker.wire import WireError


def test_the_client_config_states_every_flag() -> None:
    assert schemas.client_config(128, 4_000_000) == {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": 128,
        "fwdbwd_max_chunk_bytes_count": 4_000_000,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


def test_requests_ignore_fields_a_newer_sdk_adds() -> None:
    body = {"session_id": "sess-abc", "type": "session_heartbeat", "new_in_0_39": {"x": 1}}
    assert schemas.SessionHeartbeatRequest.model_validate(body).session_id == "sess-abc"
    step = schemas.OptimStepRequest.model_validate(
        {"model_id": "s:train:0", "adam_params": {"learning_rate": 0.1, "nesterov": True}}
    )
    assert step.adam_params is not None and step.adam_params.learning_rate == 0.1


BIG = "x" * 5000


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (schemas.CreateSessionRequest, {"tags": ["t"] * 65}),
        (schemas.CreateSessionRequest, {"tags": ["t" * 129]}),
        (schemas.CreateSessionRequest, {"user_metadata": {"k": BIG * 4}}),
        (schemas.CreateSessionRequest, {"user_metadata": {f"k{i}": 1 for i in range(65)}}),
        (schemas.CreateSessionRequest, {"display_name": "d" * 201}),
        (schemas.TelemetryRequest, {"events": [{}] * 101}),
        (schemas.TelemetryRequest, {"events": [{"traceback": BIG * 14}]}),
        (schemas.SessionHeartbeatRequest, {"session_id": "s" * 129}),
        (schemas.SessionHeartbeatRequest, {"session_id": ""}),
        (schemas.SessionFinishRequest, {"reason": {"type": "success"}, "detail": BIG}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "user_metadata": {"k": "v" * 1025}}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "path": "a/b"}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "path": ".."}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "path": "n" * 129}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "seq_id": 2**31}),
        (schemas.SaveWeightsRequest, {"model_id": "m", "ttl_seconds": 0}),
        (schemas.WeightsInfoRequest, {"tinker_path": "t" * 513}),
        (schemas.RetrieveFutureRequest, {"request_id": "r" * 129}),
    ],
)
def test_every_string_list_and_map_of_a_request_is_bounded(
    model: type[schemas.TinkerRequest], body: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(body)


def sample(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [5, 6], "type": "encoded_text"}, {"tokens": [7]}]},
        "sampling_params": {"max_tokens": 3, "stop": ["\n\nUser:"], "temperature": 1.0},
        "sampling_session_id": "sess-abc:sample:0",
        "seq_id": 0,
    }
    return {**body, **changes}


def test_a_sample_request_and_its_prompt() -> None:
    request = schemas.SampleRequest.model_validate(sample())
    assert request.prompt_tokens() == [5, 6, 7]
    image = {"type": "image", "data": "iVBORw0K", "format": "png", "expected_tokens": 4}
    with_image = schemas.SampleRequest.model_validate(
        sample(prompt={"chunks": [{"tokens": [1]}, image]})
    )
    with pytest.raises(WireError, match=r"^prompt.chunks\[1\]: image chunks are not supported$"):
        with_image.prompt_tokens()
    negative = schemas.SampleRequest.model_validate(sample(prompt={"chunks": [{"tokens": [-1]}]}))
    with pytest.raises(WireError, match=r"prompt.chunks\[0\]: token ids must be in"):
        negative.prompt_tokens()
    empty = schemas.SampleRequest.model_validate(sample(prompt={"chunks": []}))
    with pytest.raises(WireError, match="prompt: no tokens"):
        empty.prompt_tokens()


@pytest.mark.parametrize(
    "params",
    [
        {"stop": ["s"] * 65},
        {"stop": ["s" * 257]},
        {"temperature": float("nan")},
        {"temperature": -1},
        {"top_p": 0},
        {"max_tokens": 0},
    ],
)
def test_sampling_params_are_bounded(params: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        schemas.SampleRequest.model_validate(sample(sampling_params=params))


def test_stop_takes_a_string_strings_or_token_ids() -> None:
    for stop in ["\n", ["a", "b"], [2, 3], [], None]:
        params = schemas.SampleRequest.model_validate(sample(sampling_params={"stop": stop}))
        assert params.sampling_params.stop == stop


def test_adam_params_refuse_what_would_poison_the_weights() -> None:
    for bad in [
        {"learning_rate": float("inf")},
        {"beta1": 1.0},
        {"eps": 0.0},
        {"learning_rate": -1},
    ]:
        with pytest.raises(ValidationError):
            schemas.OptimStepRequest.model_validate({"model_id": "m", "adam_params": bad})
    with pytest.raises(ValidationError, match="adam_params is required"):
        schemas.OptimStepRequest.model_validate({"model_id": "m", "seq_id": 2})
    dimuon = schemas.OptimStepRequest.model_validate(
        {"model_id": "m", "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}}
    )
    assert dimuon.optimizer_params is not None and dimuon.optimizer_params.type == "dimuon"


def test_the_two_modes_of_save_weights_for_sampler_and_load_weights() -> None:
    named = schemas.SaveWeightsForSamplerRequest.model_validate({"model_id": "m", "path": "final"})
    assert named.kind == "snapshot"
    for bad in [{}, {"path": "final", "sampling_session_seq_id": 0}]:
        with pytest.raises(ValidationError, match="either path or sampling_session_seq_id"):
            schemas.SaveWeightsForSamplerRequest.model_validate({"model_id": "m", **bad})
    path = {"path": "tinker://s:train:0/weights/ck1", "optimizer": True}
    for bad in [{}, {"session_id": "s", "model_seq_id": 1, "model_id": "s:train:0", "seq_id": 1}]:
        with pytest.raises(ValidationError, match="session_id with model_seq_id"):
            schemas.LoadWeightsRequest.model_validate({**path, **bad})
    creates = schemas.LoadWeightsRequest.model_validate(
        {**path, "session_id": "s", "model_seq_id": 1}
    )
    assert creates.creates_model
    with pytest.raises(ValidationError, match="base_model or model_path"):
        schemas.CreateSamplingSessionRequest.model_validate(
            {"session_id": "s", "sampling_session_seq_id": 0}
        )


def test_replies_require_what_the_sdk_requires_and_nothing_else() -> None:
    with pytest.raises(ValidationError):
        schemas.CreateSessionResponse()  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        schemas.GetInfoResponse(model_id="m", is_lora=True, lora_rank=8, model_name="n")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        schemas.TryAgainResponse(request_id="r", unexpected=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="path or sampling_session_id is required"):
        schemas.SaveWeightsForSamplerResponse()
    with pytest.raises(ValidationError, match="tokenizer_id must hold no ':'"):
        schemas.ModelData(model_name="org/m", tokenizer_id="C:/tok")
    assert schemas.TryAgainResponse(request_id="r").model_dump() == {
        "type": "try_again",
        "request_id": "r",
        "queue_state": "active",
        "queue_state_reason": None,
    }


# -- ids and paths ------------------------------------------------------------------------------


def test_model_and_sampler_ids_are_tinkers() -> None:
    assert schemas.training_model_id("sess-abc", 3) == "sess-abc:train:3"
    assert schemas.sampler_id("sess-abc", 0) == "sess-abc:sample:0"
    assert schemas.parse_training_model_id("sess-abc:train:3") == ("sess-abc", 3)
    for bad in ["sess-abc:sample:0", "sess-abc:train:", "a:b:train:1", "s:train:01", "s/x:train:1"]:
        with pytest.raises(WireError, match="not <session_id>:train:<n>"):
            schemas.parse_training_model_id(bad)
    for session in ["a:b", "a/b", "", "s" * 65, "a?b"]:
        with pytest.raises(WireError, match="session id"):
            schemas.training_model_id(session, 0)


def test_tinker_paths_round_trip() -> None:
    path = schemas.tinker_path("sess-abc:train:0", "sampler_weights", "000020")
    assert path == "tinker://sess-abc:train:0/sampler_weights/000020"
    assert schemas.parse_tinker_path(path) == ("sess-abc:train:0", "sampler_weights", "000020")
    assert names.CHECKPOINT_KINDS == {"weights": "training", "sampler_weights": "sampler"}


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("https://x/weights/a", "not a tinker://<model_id>/<kind>/<name> path"),
        ("tinker://s:train:0/weights", "not a tinker://<model_id>/<kind>/<name> path"),
        ("tinker://s:train:0/weights/a/b", "not a tinker://<model_id>/<kind>/<name> path"),
        ("tinker://s:train:0/external_weights/a", "external weights are not supported"),
        ("tinker://s:train:0/optimizer/a", "checkpoint kind 'optimizer'"),
        ("tinker://s:train:0/weights/..", "checkpoint name '..'"),
        ("tinker://s:train:0/weights/.hidden", "checkpoint name '.hidden'"),
        ("tinker://s:train:0/weights/a b", "checkpoint name 'a b'"),
        ("tinker://s:train:0/weights/" + "n" * 129, "checkpoint name"),
        ("tinker://s:sample:0/weights/a", "not <session_id>:train:<n>"),
        ("tinker://" + "s" * 600, "not a tinker://"),
    ],
)
def test_a_bad_tinker_path_is_refused(path: str, message: str) -> None:
    with pytest.raises(WireError, match=message.replace("(", r"\(").replace("?", r"\?")):
        schemas.parse_tinker_path(path)
