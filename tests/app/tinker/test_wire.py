"""app.tinker.wire and app.tinker.proto: the golden bytes of the protocol reference, round
trips, and every body a hostile tenant might send refused with the field named, before protobuf
allocates anything for it."""

from __future__ import annotations

import math
import struct

import pytest

from app.tinker import proto, wire
from app.tinker.wire import FwdBwdRequest, WireDatum, WireError

# Produced by the SDK's own encoder and decoder (the protocol reference, §3.9 and §3.13).
GOLDEN_REQUEST = bytes.fromhex(
    "0a09733a747261696e3a3010011a640a100a0e0a0c01000000020000000300000012300a0d7461726765745f"
    "746f6b656e73121f0a180200000000000000030000000000000004000000000000001802220103121e0a0777"
    "65696768747312130a0c000000000000803f0000803f1801220103220d63726f73735f656e74726f70792a1d"
    "0a12636c69705f6c6f775f7468726573686f6c64119a9999999999e93f3a1f0a12636c69705f6c6f775f7468"
    "726573686f6c641209099a9999999999e93f"
)
GOLDEN_OUTPUT = bytes.fromhex(
    "0a0b41727261795265636f72641232122e0a086c6f6770726f627312220a0c000080bf000000c0000000bf12"
    "1000000000000000000c00000000000000180118011a130a086c6f73733a73756d110000000000000440"
)
GOLDEN_SAMPLE = bytes.fromhex(
    "0a1c120c0700000008000000020000001a0ccdccccbdcdcc4cbe9a9999be120c0000c07f000080bf000000c0"
)
LIMITS = {"max_bytes": 100_000, "max_datums": 8, "max_tokens": 1000}


def decode(body: bytes, **limits: int) -> FwdBwdRequest:
    return wire.decode_forward_backward(body, **{**LIMITS, **limits})


def refused(body: bytes, **limits: int) -> str:
    with pytest.raises(WireError) as caught:
        decode(body, **limits)
    return str(caught.value)


def datum_body(**datum_fields: object) -> bytes:
    """A one-datum request built with our message classes (for what the SDK cannot send)."""
    msg = proto.ForwardBackwardRequestPb(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    msg.data.add(**datum_fields)
    return bytes(msg.SerializeToString())


def text_request(*lengths: int, **config: float | str) -> FwdBwdRequest:
    data = [
        WireDatum(
            tokens=list(range(1, n + 1)),
            inputs={"target_tokens": list(range(2, n + 2)), "weights": [0.5] * n},
        )
        for n in lengths
    ]
    return FwdBwdRequest("s:train:3", 9, "cross_entropy", False, dict(config), data)


# -- golden bytes and round trips ---------------------------------------------------------------


def test_the_golden_request_decodes_and_encodes_to_the_same_bytes() -> None:
    request = decode(GOLDEN_REQUEST)
    assert request == FwdBwdRequest(
        model_id="s:train:0",
        seq_id=1,
        loss_fn="cross_entropy",
        forward_only=False,
        config={"clip_low_threshold": 0.8},
        data=[
            WireDatum(
                tokens=[1, 2, 3], inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]}
            )
        ],
    )
    assert wire.encode_forward_backward(request) == GOLDEN_REQUEST


def test_the_golden_output_and_sample_response_encode_exactly() -> None:
    assert (
        wire.encode_forward_backward_output([[-1.0, -2.0, -0.5]], {"loss:sum": 2.5})
        == GOLDEN_OUTPUT
    )
    sample = wire.encode_sample_response(
        [([7, 8, 2], [-0.1, -0.2, -0.3], "stop")], [None, -1.0, -2.0]
    )
    assert sample == GOLDEN_SAMPLE


def test_two_datums_of_different_lengths_round_trip() -> None:
    request = text_request(4, 2, clip_low_threshold=0.9, loss_id="x")
    assert decode(wire.encode_forward_backward(request)) == request
    assert [len(d.tokens) for d in decode(wire.encode_forward_backward(request)).data] == [4, 2]


def test_ints_stay_ints_and_floats_are_float32() -> None:
    request = FwdBwdRequest(
        "s:train:0",
        1,
        "ppo",
        True,
        {},
        [WireDatum([5, 6], {"target_tokens": [6, 2**40], "advantages": [0.1, -1.5]})],
    )
    back = decode(wire.encode_forward_backward(request))
    assert back.forward_only is True
    assert back.data[0].inputs["target_tokens"] == [6, 2**40]
    assert back.data[0].inputs["advantages"] == [
        struct.unpack("<f", struct.pack("<f", 0.1))[0],
        -1.5,
    ]


def test_config_v2_is_read_first_and_v1_serves_older_clients() -> None:
    msg = proto.ForwardBackwardRequestPb(model_id="s:train:0", seq_id=1, loss_fn="ppo")
    msg.data.add().model_input.add().encoded_text.tokens = struct.pack("<i", 1)
    msg.loss_fn_config["clip_low_threshold"] = 0.5
    assert decode(bytes(msg.SerializeToString())).config == {"clip_low_threshold": 0.5}
    msg.loss_fn_config_v2["clip_low_threshold"].number = 0.7
    msg.loss_fn_config_v2["kind"].text = "k"
    assert decode(bytes(msg.SerializeToString())).config == {"clip_low_threshold": 0.7, "kind": "k"}
    msg.loss_fn_config_v2["empty"].SetInParent()
    assert refused(bytes(msg.SerializeToString())) == (
        "loss_fn_config_v2['empty']: neither number nor text is set"
    )


def test_the_output_holds_one_record_with_byte_offsets() -> None:
    body = wire.encode_forward_backward_output(
        [[-1.0], [], [-0.5, -0.25]], {"loss:sum": 1.75, "n:mean": 2}
    )
    out = proto.ForwardBackwardOutputPb.FromString(body)
    assert out.loss_fn_output_type == "ArrayRecord"
    (record,) = out.loss_fn_outputs
    assert record.num_datums == 3
    field = record.fields["logprobs"]
    assert field.dtype == proto.DTYPE_FLOAT32 and list(field.trailing_shape) == []
    assert proto.unpack("q", field.offsets) == [0, 4, 4, 12]
    assert proto.unpack("f", field.data) == [-1.0, -0.5, -0.25]
    assert dict(out.metrics) == {"loss:sum": 1.75, "n:mean": 2.0}


@pytest.mark.parametrize("key", ["loss", "loss:sum:x", ":sum", "loss:average"])
def test_a_metric_key_the_sdk_cannot_combine_is_a_bug_of_ours(key: str) -> None:
    with pytest.raises(ValueError, match="metric key"):
        wire.encode_forward_backward_output([[0.0]], {key: 1.0})


def test_the_sample_response_writes_logprobs_always_and_nan_for_none() -> None:
    body = wire.encode_sample_response([([1], [-0.5], "length"), ([], [], "stop")], None)
    out = proto.SampleResponsePb.FromString(body)
    assert [s.stop_reason for s in out.sequences] == [1, 0]
    assert out.sequences[1].HasField("logprobs")  # empty, but present
    assert not out.HasField("prompt_logprobs")
    body = wire.encode_sample_response([], [None, -1.0, None])
    values = proto.unpack("f", proto.SampleResponsePb.FromString(body).prompt_logprobs)
    assert math.isnan(values[0]) and values[1] == -1.0 and math.isnan(values[2])
    with pytest.raises(ValueError, match="stop_reason"):
        wire.encode_sample_response([([1], [0.0], "eos")], None)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        wire.encode_sample_response([([1, 2], [0.0], "stop")], None)


# -- what a tenant may send, refused by name ----------------------------------------------------


def test_an_oversize_body_is_refused_before_anything_is_read() -> None:
    assert refused(GOLDEN_REQUEST, max_bytes=100) == "body: 194 bytes, over the limit of 100"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\x1a\xff", "data: a malformed or truncated varint"),
        (b"\x1a\x10\x00", "data: 16 bytes run past the end of the message"),
        (b"\x18\x01", "data: wire type 0, but the field needs 2"),
        (b"\x1b", "data: wire type 3 is not used by this schema"),
        (b"\x0a\x02\xff\xfe", "model_id: not valid UTF-8"),
        (b"\x1a\x03\x0a\x01\x02", "data[0].model_input[0].<field 0>: wire type 2 is not used"),
        (b"\x00", "<field 0>: wire type 0 is not used by this schema"),
        (b"", "data: no datums"),
        (b"garbage!", "<field 12>: wire type 7 is not used by this schema"),
    ],
)
def test_malformed_protobuf_is_refused_naming_the_field(body: bytes, message: str) -> None:
    assert refused(body).startswith(message)


def test_image_and_dmel_chunks_are_refused() -> None:
    msg = proto.ForwardBackwardRequestPb(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    for _ in range(2):
        msg.data.add().model_input.add().encoded_text.tokens = struct.pack("<i", 1)
    msg.data[1].model_input.add().image.data = b"\x89PNG"
    body = bytes(msg.SerializeToString())
    assert refused(body) == "data[1].model_input[1]: image chunks are not supported"
    msg.data[1].model_input[1].dmel.dmel = b"x"
    assert refused(bytes(msg.SerializeToString())) == (
        "data[1].model_input[1]: dmel (audio) chunks are not supported"
    )


def test_token_chunks_are_checked() -> None:
    chunk = proto.MESSAGES["Chunk"]
    empty = datum_body(model_input=[chunk()])
    assert refused(empty) == "data[0].model_input[0]: an empty chunk (no encoded_text)"
    ragged = datum_body(model_input=[chunk(encoded_text={"tokens": b"\x01\x00\x00"})])
    assert (
        refused(ragged) == "data[0].model_input[0].encoded_text.tokens: 3 bytes, not whole int32s"
    )
    negative = datum_body(model_input=[chunk(encoded_text={"tokens": struct.pack("<2i", 3, -1)})])
    assert refused(negative) == "data[0].model_input: a negative token id (-1)"
    assert refused(datum_body()) == "data[0].model_input: no tokens"


def test_tokens_over_the_limit_are_refused_before_they_are_unpacked() -> None:
    body = wire.encode_forward_backward(text_request(600, 600))
    assert decode(body, max_tokens=1200).data[1].tokens[-1] == 600
    assert refused(body, max_tokens=1199) == (
        "data[1].model_input[0]: the request holds more than 1199 tokens"
    )


def test_more_datums_than_allowed_are_refused_by_the_scan() -> None:
    body = wire.encode_forward_backward(text_request(1, 1, 1))
    assert refused(body, max_datums=2) == "data[2]: more than 2 entries"


def tensor_body(**tensor: object) -> bytes:
    msg = proto.ForwardBackwardRequestPb(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = struct.pack("<3i", 1, 2, 3)
    datum.loss_fn_inputs["weights"].CopyFrom(proto.MESSAGES["Tensor"](**tensor))
    return bytes(msg.SerializeToString())


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ({"dtype": 99, "shape": [3], "dense": b"\0" * 12}, "dtype 99 is not supported"),
        ({"dtype": proto.DTYPE_INT32, "shape": [3], "dense": b"\0" * 12}, "dtype DTYPE_INT32"),
        ({"shape": [3], "dense": b"\0" * 12}, "dtype DTYPE_UNSPECIFIED is not supported"),
        (
            {"dtype": proto.DTYPE_FLOAT32, "shape": [3], "dense": b"\0" * 8},
            "8 bytes of dense data, but shape [3] of float32 needs 12",
        ),
        (
            {"dtype": proto.DTYPE_INT64, "shape": [3]},
            "0 bytes of dense data, but shape [3] of int64",
        ),
        ({"dtype": proto.DTYPE_FLOAT32, "shape": [-1]}, "shape [-1] of float32 needs 0"),
        (
            {"dtype": proto.DTYPE_FLOAT32, "shape": [2], "dense": b"\0" * 8},
            "length 2, but model_input has 3",
        ),
        (
            {"dtype": proto.DTYPE_FLOAT32, "shape": [3, 1], "dense": b"\0" * 12},
            "2-D tensors (shape [3, 1]) are not supported yet",
        ),
        (
            {"dtype": proto.DTYPE_INT64, "shape": [3, 2], "sparse_csr": {"values": b""}},
            "sparse (CSR) tensors (shape [3, 2]) are not supported",
        ),
        (
            {"dtype": proto.DTYPE_FLOAT32, "shape": [1] * 9},
            "data[0].loss_fn_inputs[0].value.shape: more than 8 entries",
        ),
    ],
)
def test_bad_tensors_are_refused_naming_the_input(tensor: dict[str, object], message: str) -> None:
    error = refused(tensor_body(**tensor))
    assert message in error
    if not message.startswith("data["):
        assert error.startswith("data[0].loss_fn_inputs['weights']: ")


def test_a_tensor_without_shape_is_one_dimensional() -> None:
    body = tensor_body(dtype=proto.DTYPE_FLOAT32, dense=struct.pack("<3f", 1, 2, 3))
    assert decode(body).data[0].inputs == {"weights": [1.0, 2.0, 3.0]}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_id", "m" * 300, "model_id: a string of 300 bytes, over 256"),
        ("loss_fn", "l" * 65, "loss_fn: a string of 65 bytes, over 64"),
    ],
)
def test_strings_are_bounded(field: str, value: str, message: str) -> None:
    msg = proto.ForwardBackwardRequestPb(**{field: value})
    assert refused(bytes(msg.SerializeToString())) == message


def test_too_many_loss_inputs_are_refused() -> None:
    msg = proto.ForwardBackwardRequestPb()
    datum = msg.data.add()
    for i in range(17):
        datum.loss_fn_inputs[f"k{i}"].dtype = proto.DTYPE_FLOAT32
    assert refused(bytes(msg.SerializeToString())).endswith(": more than 16 entries")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # a million empty chunks in one datum (each a protobuf message if parsed)
        (b"\x1a\xc0\x84\x3d" + b"\x0a\x00" * 500_000, "data[0].model_input[4096]: more than 4096"),
        # as many empty datums
        (b"\x1a\x00" * 500_000, "data[8]: more than 8 entries"),
        # and as many unknown fields, which protobuf would keep
        (b"\x48\x01" * 500_000, "the body holds more protobuf elements than allowed"),
    ],
)
def test_a_hostile_body_is_refused_without_being_parsed(
    body: bytes, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parse_nothing() -> None:
        raise AssertionError("a hostile body reached the protobuf parser")

    monkeypatch.setattr(wire, "ForwardBackwardRequestPb", parse_nothing)
    assert message in refused(body, max_bytes=2_000_000)


def test_the_advertised_chunk_size_keeps_the_sdks_chunks_within_our_limits() -> None:
    """The SDK packs datums while its estimate (4 B a token plus tensor bytes, no framing)
    stays under fwdbwd_max_chunk_bytes_count; every chunk it would send must decode."""
    limits = [(5_000_000, 65_536, 256), (1_000_000, 10**7, 1024), (5_000_000, 1000, 256)]
    for max_body, max_tokens, max_datums in limits:
        budget = wire.fwdbwd_chunk_bytes(max_body, max_tokens, max_datums)
        long_key = "sequence_ratio_mask"
        datum = WireDatum(
            tokens=[7] * 3,
            inputs={"target_tokens": [1] * 3} | {f"{long_key}{i}": [0.5] * 3 for i in range(6)},
        )
        estimate = 4 * 3 + 8 * 3 + 6 * 4 * 3
        chunk = [datum] * min(max_datums, budget // estimate)
        body = wire.encode_forward_backward(FwdBwdRequest("s:train:0", 1, "ppo", False, {}, chunk))
        assert len(body) <= max_body
        decode(body, max_bytes=max_body, max_datums=max_datums, max_tokens=max_tokens)
        # The cross-entropy datum with the fewest bytes a token: 12 (int32 token, int64 target).
        lean = WireDatum(tokens=list(range(1, 101)), inputs={"target_tokens": [1] * 100})
        many = [lean] * min(max_datums, budget // 1200)
        body = wire.encode_forward_backward(FwdBwdRequest("s:train:0", 1, "x", False, {}, many))
        decode(body, max_bytes=max_body, max_datums=max_datums, max_tokens=max_tokens)


def test_the_schema_builds_every_message_and_enum() -> None:
    names = {m.name for m in proto.file_descriptor().message_type}
    assert {
        "ForwardBackwardRequest",
        "Datum",
        "Chunk",
        "Tensor",
        "SparseCsr",
        "LossConfigValue",
    } <= names
    assert {"ForwardBackwardOutput", "ArrayRecord", "BatchedTensor"} <= names
    assert {"SampleResponse", "SampledSequence", "TopkLogprobs"} <= names
    assert proto.DTYPE_NAMES == {
        0: "DTYPE_UNSPECIFIED",
        1: "DTYPE_FLOAT32",
        2: "DTYPE_INT64",
        3: "DTYPE_INT32",
        4: "DTYPE_BFLOAT16",
    }
    assert wire.PROTOBUF_CONTENT_TYPE == "application/x-protobuf"
