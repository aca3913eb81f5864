"""The wire format against the official SDK (tinker 0.38.0): our schema is the SDK's, message by
message; request bodies the SDK's own encoder wrote (fixtures/, made by fixtures/generate.py)
decode to what the SDK was given; and the SDK itself, in its own venv (.venv-tinker, built by
scripts/setup.sh), reads our results and validates our JSON replies."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from app.tinker import proto, schema_parts, schemas, wire
from app.tinker.wire import FwdBwdRequest, WireDatum, WireError

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
ROOT = HERE.parents[2]
TINKER_PYTHON = Path(
    os.environ.get("GRPO_TEST_TINKER_PYTHON", ROOT / ".venv-tinker" / "bin" / "python")
)
NO_TINKER = (
    f"no Tinker SDK to test against: {TINKER_PYTHON} is missing (scripts/setup.sh builds "
    ".venv-tinker with tinker==0.38.0; GRPO_TEST_TINKER_PYTHON names another interpreter)"
)
LIMITS = {"max_bytes": 5_000_000, "max_datums": 256, "max_tokens": 65_536}


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.bin").read_bytes()


def _comparable(message: descriptor_pb2.DescriptorProto) -> descriptor_pb2.DescriptorProto:
    copy = descriptor_pb2.DescriptorProto()
    copy.CopyFrom(message)
    for m in [copy, *copy.nested_type]:
        for field in m.field:
            field.ClearField("json_name")  # protoc's extra, not on the wire
    return copy


def test_every_message_we_declare_is_the_sdks() -> None:
    sdk = descriptor_pb2.FileDescriptorProto.FromString(fixture("sdk_descriptor"))
    assert sdk.package == proto.PACKAGE and sdk.syntax == "proto3"
    theirs = {m.name: m for m in sdk.message_type}
    ours = proto.file_descriptor()
    for message in ours.message_type:
        assert _comparable(message) == _comparable(theirs[message.name]), message.name
    assert {e.name: e for e in ours.enum_type} == {e.name: e for e in sdk.enum_type}
    # What we leave out is what 0.38 sends as JSON.
    left_out = set(theirs) - {m.name for m in ours.message_type}
    assert left_out == {"SamplingParams", "StopStrings", "StopTokens"}


SDK_REQUESTS = {
    "golden_cross_entropy": FwdBwdRequest(
        "s:train:0",
        1,
        "cross_entropy",
        False,
        {"clip_low_threshold": 0.8},
        [WireDatum([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]})],
    ),
    "two_datums": FwdBwdRequest(
        "sess-abc:train:0",
        7,
        "cross_entropy",
        False,
        {},
        [
            WireDatum(
                [5, 6, 7, 8], {"target_tokens": [6, 7, 8, 9], "weights": [0.0, 1.0, 1.0, 1.0]}
            ),
            WireDatum([10, 11], {"target_tokens": [11, 12], "weights": [1.0, 0.5]}),
        ],
    ),
    "importance_sampling": FwdBwdRequest(
        "sess-abc:train:0",
        3,
        "importance_sampling",
        False,
        {},
        [
            WireDatum(
                [1, 2, 3, 4, 5],
                {
                    "target_tokens": [0, 0, 4, 5, 6],
                    "logprobs": [0.0, 0.0, -0.5, -1.25, -2.0],
                    "advantages": [0.0, 0.0, 1.5, 1.5, 1.5],
                },
            )
        ],
    ),
    "ppo_forward_only": FwdBwdRequest(
        "sess-abc:train:0",
        1,
        "ppo",
        True,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        [
            WireDatum(
                [9, 8, 7],
                {
                    "target_tokens": [8, 7, 6],
                    "logprobs": [-1.0, -1.0, -1.0],
                    "advantages": [1.0, -1.0, 0.0],
                    "weights": [1, 1, 0],  # an int64 numpy array stays ints
                },
            )
        ],
    ),
    "config_text": FwdBwdRequest(
        "sess-abc:train:0",
        1,
        "custom",
        False,
        {"loss_id": "loss-1", "beta": 0.05},
        [WireDatum([1, 2], {"target_tokens": [2, 3]})],
    ),
    "provenance_spans": FwdBwdRequest(
        "sess-abc:train:0",
        1,
        "importance_sampling",
        False,
        {},
        [
            WireDatum(
                [1, 2, 3],
                {
                    "target_tokens": [2, 3, 4],
                    "logprobs": [0.0, -1.0, -1.0],
                    "advantages": [0.0, 1.0, 1.0],
                },
            )
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(SDK_REQUESTS))
def test_a_body_the_sdk_encoded_decodes_to_what_it_was_given(name: str) -> None:
    assert wire.decode_forward_backward(fixture(name), **LIMITS) == SDK_REQUESTS[name]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("image_chunk", "data[1].model_input[1]: image chunks are not supported"),
        (
            "two_d_tensor",
            "data[0].loss_fn_inputs['target_tokens']: 2-D tensors (shape [3, 2]) are not "
            "supported yet; send 1-D tensors as long as the datum's model_input",
        ),
        (
            "sparse_tensor",
            "data[0].loss_fn_inputs['target_tokens']: sparse (CSR) tensors (shape [3, 2]) are "
            "not supported; send 1-D dense tensors as long as the datum's model_input",
        ),
    ],
)
def test_what_the_sdk_can_send_but_we_do_not_serve_is_refused_by_name(
    name: str, message: str
) -> None:
    with pytest.raises(WireError) as caught:
        wire.decode_forward_backward(fixture(name), **LIMITS)
    assert str(caught.value) == message


def test_the_sdks_json_bodies_validate_against_our_request_schemas() -> None:
    bodies = json.loads((FIXTURES / "sdk_json_bodies.json").read_text())
    models: dict[str, type[schemas.TinkerRequest]] = {
        "client_config": schemas.ClientConfigRequest,
        "create_session": schemas.CreateSessionRequest,
        "session_heartbeat": schemas.SessionHeartbeatRequest,
        "telemetry": schemas.TelemetryRequest,
        "create_model": schemas.CreateModelRequest,
        "get_info": schemas.GetInfoRequest,
        "optim_step": schemas.OptimStepRequest,
        "save_weights": schemas.SaveWeightsRequest,
        "save_weights_for_sampler": schemas.SaveWeightsForSamplerRequest,
        "load_weights": schemas.LoadWeightsRequest,
        "create_sampling_session": schemas.CreateSamplingSessionRequest,
        "asample": schemas.SampleRequest,
        "retrieve_future": schemas.RetrieveFutureRequest,
        "weights_info": schemas.WeightsInfoRequest,
        "finish": schemas.SessionFinishRequest,
    }
    assert set(bodies) == set(models)
    for endpoint, model in models.items():
        for body in bodies[endpoint]:
            model.model_validate(body)
    step = schemas.OptimStepRequest.model_validate(bodies["optim_step"][0])
    assert step.adam_params is not None and step.adam_params.learning_rate == 4e-5
    sample = schemas.SampleRequest.model_validate(bodies["asample"][0])
    assert sample.prompt_tokens() == [5, 6, 7]
    assert sample.sampling_params.stop == ["\n\nUser:"]
    assert schemas.SampleRequest.model_validate(bodies["asample"][1]).sampling_params.stop == [2, 3]
    loads = [schemas.LoadWeightsRequest.model_validate(b) for b in bodies["load_weights"]]
    assert [load.creates_model for load in loads] == [True, False]


# -- the SDK reading what we send ---------------------------------------------------------------


def our_replies() -> dict[str, list[dict[str, Any]]]:
    """One JSON reply of each kind, as the routes send them (model_dump(mode="json")), by the
    SDK type that reads it."""
    when = datetime(2026, 11, 1, tzinfo=UTC)
    checkpoint = schemas.Checkpoint(
        checkpoint_id="weights/ck1",
        checkpoint_type="training",
        time=when,
        tinker_path=schemas.tinker_path("sess-abc:train:0", "weights", "ck1"),
    )
    model = {"model_data": schemas.ModelData(arch="llama", model_name="org/m", tokenizer_id="/t")}
    replies: dict[str, list[Any]] = {
        "ClientConfigResponse": [schemas.client_config(256, 1_000_000)],
        "ClientDynamicConfigResponse": [schemas.DynamicConfigResponse()],
        "CreateSessionResponse": [schemas.CreateSessionResponse(session_id="sess-abc")],
        "SessionHeartbeatResponse": [schemas.SessionHeartbeatResponse()],
        "TelemetryResponse": [schemas.TelemetryResponse()],
        "GetServerCapabilitiesResponse": [
            schemas.ServerCapabilitiesResponse(
                supported_models=[schemas.SupportedModel(model_name="org/m", trainable=True)]
            )
        ],
        "HealthResponse": [schemas.HealthResponse()],
        "UntypedAPIFuture": [
            schemas.FutureResponse(request_id="req-1", model_id="sess-abc:train:0"),
            schemas.SampleFutureResponse(request_id="req-2", sample_sequence_ids=["s-1", "s-2"]),
        ],
        "TryAgainResponse": [schemas.TryAgainResponse(request_id="req-1")],
        "RequestFailedResponse": [schemas.RequestFailedResponse(error="boom", category="user")],
        "CreateModelResponse": [schemas.CreateModelResponse(model_id="sess-abc:train:0")],
        "GetInfoResponse": [
            schemas.GetInfoResponse(
                **model, model_id="sess-abc:train:0", is_lora=True, lora_rank=8, model_name="org/m"
            )
        ],
        "OptimStepResponse": [
            schemas.OptimStepResponse(metrics=None),
            schemas.OptimStepResponse(metrics={"optim/grad_norm:mean": 1.5}),
        ],
        "SaveWeightsResponse": [schemas.SaveWeightsResponse(path=checkpoint.tinker_path)],
        "SaveWeightsForSamplerResponseInternal": [
            schemas.SaveWeightsForSamplerResponse(
                path="tinker://sess-abc:train:0/sampler_weights/f"
            ),
            schemas.SaveWeightsForSamplerResponse(sampling_session_id="sess-abc:sample:0"),
        ],
        "LoadWeightsResponse": [
            schemas.LoadWeightsResponse(path=checkpoint.tinker_path, model_id="sess-abc:train:1")
        ],
        "CreateSamplingSessionResponse": [
            schemas.CreateSamplingSessionResponse(sampling_session_id="sess-abc:sample:1")
        ],
        "GetSamplerResponse": [
            schemas.GetSamplerResponse(
                sampler_id="sess-abc:sample:1", base_model="org/m", model_path=None
            )
        ],
        "CheckpointsListResponse": [
            schemas.CheckpointsListResponse(
                checkpoints=[checkpoint, checkpoint.model_copy(update={"expires_at": when})],
                cursor=schemas.Cursor(offset=0, limit=20, total_count=2),
            )
        ],
        "WeightsInfoResponse": [
            schemas.WeightsInfoResponse(base_model="org/m", is_lora=True, lora_rank=8)
        ],
        "TrainingRun": [
            schema_parts.TrainingRun(
                training_run_id="sess-abc:train:0",
                base_model="org/m",
                model_owner="p-1",
                is_lora=True,
                last_request_time=when,
                last_checkpoint=checkpoint,
            )
        ],
    }
    return {
        name: [r if isinstance(r, dict) else r.model_dump(mode="json") for r in items]
        for name, items in replies.items()
    }


@pytest.fixture(scope="module")
def sdk_reading() -> dict[str, Any]:
    """What the SDK makes of our results and replies (one run of its interpreter)."""
    if not TINKER_PYTHON.exists():
        pytest.skip(NO_TINKER)
    given: dict[str, Any] = {
        # One forward_backward call split into two chunks, as the SDK would send it.
        "fwdbwd": [
            wire.encode_forward_backward_output(
                [[-1.0, -2.0], [-0.5]], {"loss:sum": 2.5, "n:mean": 1.0}
            ),
            wire.encode_forward_backward_output(
                [[-0.25, 0.0, -3.0]], {"loss:sum": 1.0, "n:mean": 4.0}
            ),
        ],
        "sample": {
            "hex": wire.encode_sample_response(
                [([7, 8, 2], [-0.1, -0.2, -0.3], "stop"), ([9], [-1.5], "length")],
                [None, -1.0, -2.0],
            ),
            "ids": ["seq-6", "seq-7"],
        },
        "responses": our_replies(),
    }
    given["fwdbwd"] = [body.hex() for body in given["fwdbwd"]]
    given["sample"]["hex"] = given["sample"]["hex"].hex()
    done = subprocess.run(
        [str(TINKER_PYTHON), str(HERE / "sdk_check.py")],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_sdk_reads_and_combines_our_forward_backward_outputs(
    sdk_reading: dict[str, Any],
) -> None:
    out = sdk_reading["fwdbwd"]
    assert out["loss_fn_output_type"] == "ArrayRecord"
    # Sums add; means average weighted by each chunk's datums (2 and 1).
    assert out["metrics"] == {"loss:sum": 3.5, "n:mean": pytest.approx(2.0)}
    assert out["logprobs"] == [
        {"dtype": "float32", "shape": [2], "data": [-1.0, -2.0]},
        {"dtype": "float32", "shape": [1], "data": [-0.5]},
        {"dtype": "float32", "shape": [3], "data": [-0.25, 0.0, -3.0]},
    ]


def test_the_sdk_reads_our_sample_response(sdk_reading: dict[str, Any]) -> None:
    out = sdk_reading["sample"]
    assert [s["tokens"] for s in out["sequences"]] == [[7, 8, 2], [9]]
    assert [s["stop_reason"] for s in out["sequences"]] == ["stop", "length"]
    assert [s["sequence_id"] for s in out["sequences"]] == ["seq-6", "seq-7"]
    assert out["sequences"][1]["logprobs"] == [-1.5]
    assert out["sequences"][0]["logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert out["prompt_logprobs"] == [None, -1.0, -2.0]


def test_the_sdk_accepts_every_json_reply_of_ours(sdk_reading: dict[str, Any]) -> None:
    results = sdk_reading["responses"]
    assert set(results) == set(our_replies())
    failed = {name: r for name, r in results.items() if any(x != "ok" for x in r)}
    assert failed == {}
