"""The protobuf bodies of the Tinker API: a ``forward_backward`` request in, its output and a
sample's result out (the SDK reads those two results only as protobuf). The schema is
``app.tinker.proto``.

A request body comes from a tenant, so decoding is bounded before protobuf allocates anything: a
walk over the raw bytes (``_Scan``) checks every length, wire type, string and count against
the limits first, and token counts are checked before tokens are unpacked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FieldDescriptorProto as _F
from google.protobuf.message import DecodeError

from app.tinker.proto import (
    DTYPE_FLOAT32,
    DTYPE_INT64,
    DTYPE_NAMES,
    ITEMSIZE,
    PACKAGE,
    STOP_REASONS,
    ForwardBackwardOutputPb,
    ForwardBackwardRequestPb,
    SampleResponsePb,
    descriptor,
    pack,
    unpack,
)

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
# Metric keys are "name:reduction"; the SDK splits on ":" to combine chunks and crashes on a key
# with no colon or two, and silently drops unknown reductions.
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


class WireError(ValueError):
    """A body we refuse, its message naming the field (``data[2].model_input[0]: ...``)."""


# -- the bounded walk over a request's raw bytes ---------------------------------------------------

_VARINT_TYPES = {_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_BOOL, _F.TYPE_ENUM}
_HIGH_BYTES = bytes(range(0x80, 0x100))
_STRING_CAP = 256  # bytes of any string field not in the caps
_REPEATED_CAP = 64  # occurrences of any repeated field not in the caps


# A field's path, written out only for an error: (parent, field name, index of a repeated one).
_Path = tuple[Any, str, int | None] | None


def _render(path: _Path) -> str:
    parts = []
    while path is not None:
        path, name, index = path
        parts.append(name if index is None else f"{name}[{index}]")
    return ".".join(reversed(parts)) or "body"


class _Bad(Exception):
    """A fault the scan found in the field it is reading."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        value |= (buf[i] & 0x7F) << shift
        if buf[i] < 0x80:
            return value, i + 1
        shift += 7
    raise _Bad("a malformed or truncated varint")


def _wire_type(field: FieldDescriptor) -> int:
    if field.type in _VARINT_TYPES:
        return 0
    return {_F.TYPE_DOUBLE: 1}.get(field.type, 2)


@dataclass
class _Scan:
    caps: Mapping[str, int]  # field full name -> most occurrences per message, or string bytes
    budget: int  # fields (and packed values) the whole body may still hold

    def walk(self, buf: memoryview, desc: Descriptor, where: _Path) -> None:
        pos, counts, fields = 0, dict[int, int](), desc.fields_by_number
        number, field = -1, None
        try:
            while pos < len(buf):
                number, field = -1, None
                key, pos = _varint(buf, pos)
                number, wire = key >> 3, key & 7
                field = fields.get(number)
                self.budget -= 1  # unknown fields too: each costs a turn of this loop
                if self.budget < 0:
                    raise _Bad("the body holds more protobuf elements than allowed")
                if number == 0 or wire in (3, 4) or wire > 5:
                    raise _Bad(f"wire type {wire} is not used by this schema")
                size = {1: 8, 5: 4}.get(wire, 0)
                if wire == 0:
                    _, pos = _varint(buf, pos)
                elif wire == 2:
                    size, pos = _varint(buf, pos)
                if size > len(buf) - pos:
                    raise _Bad(f"{size} bytes run past the end of the message")
                if field is not None:
                    self._field(buf[pos : pos + size], wire, field, where, counts)
                pos += size
        except _Bad as bad:
            name = field.name if field else f"<field {number}>"
            where = (where, name, None) if number >= 0 else where
            raise WireError(f"{_render(where)}: {bad}") from None

    def _field(
        self,
        body: memoryview,
        wire: int,
        field: FieldDescriptor,
        where: _Path,
        counts: dict[int, int],
    ) -> None:
        expected = _wire_type(field)
        packed = field.is_repeated and expected != 2 and wire == 2
        if wire != expected and not packed:
            raise _Bad(f"wire type {wire}, but the field needs {expected}")
        index = counts.get(field.number, 0)
        count = 1
        if packed:  # a packed repeated number: count its values without reading them
            if expected == 0:
                count = len(bytes(body).translate(None, _HIGH_BYTES))  # the last byte of each
                if body and body[-1] >= 0x80:
                    raise _Bad("a truncated varint in a packed array")
            else:
                count, rest = divmod(len(body), 8 if expected == 1 else 4)
                if rest:
                    raise _Bad(f"a packed array of {len(body)} bytes")
        counts[field.number] = index + count
        path = (where, field.name, index if field.is_repeated and not packed else None)
        if field.is_repeated:
            cap = self.caps.get(field.full_name, _REPEATED_CAP)
            if counts[field.number] > cap:
                raise WireError(f"{_render(path)}: more than {cap} entries")
        self.budget -= count - 1  # the field itself was counted by walk
        if self.budget < 0:
            raise _Bad("the body holds more protobuf elements than allowed")
        if field.type == _F.TYPE_STRING:
            limit = self.caps.get(field.full_name, _STRING_CAP)
            if len(body) > limit:
                raise _Bad(f"a string of {len(body)} bytes, over {limit}")
            try:
                bytes(body).decode("utf-8")
            except UnicodeDecodeError:
                raise _Bad("not valid UTF-8") from None
        elif field.type == _F.TYPE_MESSAGE:
            self.walk(body, field.message_type, path)


def _caps(max_datums: int) -> dict[str, int]:
    p = PACKAGE
    return {
        f"{p}.ForwardBackwardRequest.data": max_datums,
        f"{p}.ForwardBackwardRequest.model_id": 256,
        f"{p}.ForwardBackwardRequest.loss_fn": 64,
        f"{p}.ForwardBackwardRequest.LossFnConfigEntry.key": 64,
        f"{p}.ForwardBackwardRequest.LossFnConfigV2Entry.key": 64,
        f"{p}.LossConfigValue.text": 1024,
        f"{p}.Datum.model_input": 4096,  # chunks: renderers send one or a few per message
        f"{p}.Datum.loss_fn_inputs": 16,  # the losses read at most 7 (§5)
        f"{p}.Datum.LossFnInputsEntry.key": 64,
        f"{p}.Datum.model_input_spans": 4096,
        f"{p}.Datum.loss_fn_input_spans": 4096,
        f"{p}.Tensor.shape": 8,
        f"{p}.ImageChunk.format": 16,
    }


# -- forward_backward in ------------------------------------------------------------------------


@dataclass(frozen=True)
class WireDatum:
    """One datum: its tokens (every chunk's, in order) and its loss inputs as 1-D lists
    (int64 tensors as ints, float32 as floats), each as long as ``tokens``."""

    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]


@dataclass(frozen=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float | str]
    data: list[WireDatum]


_DTYPES = {DTYPE_FLOAT32: ("f", "float32"), DTYPE_INT64: ("q", "int64")}


def _tensor(tensor: Any, at: str, length: int) -> list[Any]:
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raise WireError(
            f"{at}: sparse (CSR) tensors (shape {list(tensor.shape)}) are not supported; "
            "send 1-D dense tensors as long as the datum's model_input"
        )
    if tensor.dtype not in _DTYPES:
        name = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        raise WireError(f"{at}: dtype {name} is not supported (float32 or int64)")
    code, dtype = _DTYPES[tensor.dtype]
    shape, raw = list(tensor.shape), tensor.dense
    if len(shape) > 1:
        raise WireError(
            f"{at}: {len(shape)}-D tensors (shape {shape}) are not supported yet; "
            "send 1-D tensors as long as the datum's model_input"
        )
    # The SDK omits the shape of a TensorData built without one: it is then 1-D.
    count = shape[0] if shape else len(raw) // ITEMSIZE[code]
    if count < 0 or len(raw) != count * ITEMSIZE[code]:
        raise WireError(
            f"{at}: {len(raw)} bytes of dense data, but shape {shape or [count]} of {dtype} "
            f"needs {max(count, 0) * ITEMSIZE[code]}"
        )
    if count != length:
        raise WireError(f"{at}: length {count}, but model_input has {length} tokens")
    return unpack(code, raw)


def _datum(datum: Any, where: str, tokens_left: int, max_tokens: int) -> WireDatum:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        at, kind = f"{where}.model_input[{j}]", chunk.WhichOneof("chunk")
        if kind == "image":
            raise WireError(f"{at}: image chunks are not supported")
        if kind == "dmel":
            raise WireError(f"{at}: dmel (audio) chunks are not supported")
        if kind is None:
            raise WireError(f"{at}: an empty chunk (no encoded_text)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{at}.encoded_text.tokens: {len(raw)} bytes, not whole int32s")
        if len(tokens) + len(raw) // 4 > tokens_left:  # before unpacking them
            raise WireError(f"{at}: the request holds more than {max_tokens} tokens")
        tokens.extend(unpack("i", raw))
    if not tokens:
        raise WireError(f"{where}.model_input: no tokens")
    if min(tokens) < 0:
        raise WireError(f"{where}.model_input: a negative token id ({min(tokens)})")
    inputs = {
        key: _tensor(tensor, f"{where}.loss_fn_inputs[{key!r}]", len(tokens))
        for key, tensor in sorted(datum.loss_fn_inputs.items())
    }
    return WireDatum(tokens=tokens, inputs=inputs)


def _config(msg: Any) -> dict[str, float | str]:
    # The SDK writes every entry to v2 (numbers and strings) and the numbers also to the legacy
    # map: when v2 has entries it is the whole config, and v1 serves older clients.
    if not msg.loss_fn_config_v2:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key!r}]: neither number nor text is set")
        config[key] = float(value.number) if kind == "number" else str(value.text)
    return config


def decode_forward_backward(
    body: bytes, *, max_bytes: int, max_datums: int, max_tokens: int
) -> FwdBwdRequest:
    """The ForwardBackwardRequest in ``body`` (not compressed), or WireError naming the field.

    ``max_tokens`` bounds the tokens of all datums together; every loss input must be 1-D and as
    long as its datum's tokens, so the lists returned stay proportional to the body's bytes.
    Value checks (token ids against the vocabulary, the loss's required keys, seq order) are the
    caller's."""
    if len(body) > max_bytes:
        raise WireError(f"body: {len(body)} bytes, over the limit of {max_bytes}")
    desc = descriptor("ForwardBackwardRequest")
    # Each field costs protobuf some tens of bytes and us a turn of a Python loop: allow what
    # honest datums need (about 30 fields for 4 loss inputs), not one per byte of the body.
    scan = _Scan(_caps(max_datums), budget=128 * max_datums + max_tokens + 4096)
    scan.walk(memoryview(body), desc, None)
    msg = ForwardBackwardRequestPb()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({exc})") from None
    if not msg.data:
        raise WireError("data: no datums")
    data: list[WireDatum] = []
    tokens_left = max_tokens
    for i, datum in enumerate(msg.data):
        data.append(_datum(datum, f"data[{i}]", tokens_left, max_tokens))
        tokens_left -= len(data[-1].tokens)
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        forward_only=msg.forward_only,
        config=_config(msg),
        data=data,
    )


def encode_forward_backward(request: FwdBwdRequest) -> bytes:
    """``request`` as the SDK would send it (numbers in both config maps, int lists as int64,
    float lists as float32): for tests and for clients of our own."""
    msg = ForwardBackwardRequestPb(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        forward_only=request.forward_only,
    )
    for key, value in request.config.items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = msg.loss_fn_config_v2[key].number = float(value)
    for datum in request.data:
        out = msg.data.add()
        out.model_input.add().encoded_text.tokens = pack("i", datum.tokens)
        for key, values in datum.inputs.items():
            ints = bool(values) and all(isinstance(v, int) for v in values)
            tensor = out.loss_fn_inputs[key]
            tensor.dtype = DTYPE_INT64 if ints else DTYPE_FLOAT32
            tensor.shape.append(len(values))
            tensor.dense = pack("q" if ints else "f", values)
    return bytes(msg.SerializeToString(deterministic=True))


def fwdbwd_chunk_bytes(max_body_bytes: int, max_tokens: int, max_datums: int) -> int:
    """The ``fwdbwd_max_chunk_bytes_count`` to advertise (client/config) so that the SDK's
    chunks pass ``decode_forward_backward``. The SDK sizes a datum at 4 B per token plus its
    tensors' bytes, without protobuf framing: reserve 512 B of framing per datum, and as every
    loss sends int64 target_tokens (12 B per token in all), cap tokens through the bytes."""
    return max(1, min(max_body_bytes - 512 * max_datums - 4096, 12 * max_tokens))


# -- results out ----------------------------------------------------------------------------------


def check_metric_key(key: str) -> None:
    """Raise ValueError unless ``key`` is "name:reduction" with a reduction the SDK combines."""
    parts = key.split(":")
    if len(parts) != 2 or not parts[0] or parts[1] not in METRIC_REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must be 'name:<{'|'.join(sorted(METRIC_REDUCTIONS))}>'"
        )


def encode_forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord holding every datum's target logprobs (float32,
    concatenated, with int64 byte offsets), and the metrics (``loss:sum`` among them)."""
    out = ForwardBackwardOutputPb(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(num_datums=len(logprobs))
    offsets, total = [0], 0
    for values in logprobs:
        total += 4 * len(values)
        offsets.append(total)
    field = record.fields["logprobs"]
    field.data = b"".join(pack("f", values) for values in logprobs)
    field.offsets = pack("q", offsets)
    field.dtype = DTYPE_FLOAT32
    for key, value in metrics.items():
        check_metric_key(key)
        out.metrics[key] = float(value)
    return bytes(out.SerializeToString(deterministic=True))


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None
) -> bytes:
    """A SampleResponse: per sequence its tokens, their logprobs (always written: the cookbook
    asserts they are there) and "stop" or "length"; the prompt's logprobs with None as NaN
    (position 0 and unscored positions), which the SDK turns back into None."""
    out = SampleResponsePb()
    for tokens, logprobs, stop_reason in sequences:
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason {stop_reason!r} is not 'stop' or 'length'")
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
        out.sequences.add(
            stop_reason=STOP_REASONS[stop_reason],
            tokens=pack("i", tokens),
            logprobs=pack("f", logprobs),
        )
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = pack("f", values)
    return bytes(out.SerializeToString(deterministic=True))
