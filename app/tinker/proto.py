"""The protobuf schema of the Tinker API (the SDK's ``tinker_public`` package), built at import
from the proto text below into a private descriptor pool: no protoc step, no generated module,
nothing of the SDK imported, and no clash with an SDK loaded in the same process. Only field
numbers and types matter on the wire; tests/app/tinker checks every message against the SDK's
own descriptor. Also the codecs of its byte fields, little-endian C-order arrays (``array``:
the API imports no numpy).
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Iterable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor

PACKAGE = "tinker_public"
# tinker_public.DType and tinker_public.StopReason.
DTYPE_UNSPECIFIED, DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = range(5)
STOP_REASONS = {"stop": 0, "length": 1}

# The SDK's tinker_public.proto, abridged to what grpo reads or writes (SamplingParams & co. are
# sent as JSON by 0.38), in the proto3 subset that ``file_descriptor`` parses. Byte fields are
# little-endian arrays: tokens int32, logprobs float32, offsets and CSR indices int64.
SCHEMA = """
enum StopReason { STOP_REASON_STOP = 0; STOP_REASON_LENGTH = 1; }
enum DType { DTYPE_UNSPECIFIED = 0; DTYPE_FLOAT32 = 1; DTYPE_INT64 = 2; DTYPE_INT32 = 3;
             DTYPE_BFLOAT16 = 4; }
message ForwardBackwardRequest { string model_id = 1; int32 seq_id = 2; repeated Datum data = 3;
  string loss_fn = 4; map<string, double> loss_fn_config = 5; bool forward_only = 6;
  map<string, LossConfigValue> loss_fn_config_v2 = 7; }
message LossConfigValue { oneof value { double number = 1; string text = 2; } }
message Datum { repeated Chunk model_input = 1; map<string, Tensor> loss_fn_inputs = 2;
  repeated ProvenanceSpan model_input_spans = 3; repeated ProvenanceSpan loss_fn_input_spans = 4; }
message ProvenanceSpan { oneof span { PromptProvenanceSpan prompt_tokens = 1;
  SampledProvenanceSpan sampled_tokens = 2; } }
message PromptProvenanceSpan { string sequence_id = 1; int64 offset = 2; int64 length = 3; }
message SampledProvenanceSpan { string sequence_id = 1; int64 offset = 2; int64 length = 3; }
message Chunk { oneof chunk { EncodedTextChunk encoded_text = 1; ImageChunk image = 2;
  DmelChunk dmel = 3; } }
message EncodedTextChunk { bytes tokens = 1; }
message ImageChunk { bytes data = 1; string format = 2; optional int32 expected_tokens = 3;
  optional ImageDimensions override_dimensions = 4; }
message ImageDimensions { uint32 width = 1; uint32 height = 2; }
message DmelChunk { bytes dmel = 1; }
message Tensor { oneof encoding { bytes dense = 1; SparseCsr sparse_csr = 2; } DType dtype = 3;
  repeated int64 shape = 4; }
message SparseCsr { bytes values = 1; bytes crow_indices = 2; bytes col_indices = 3; }
message ForwardBackwardOutput { string loss_fn_output_type = 1;
  repeated ArrayRecord loss_fn_outputs = 2; map<string, double> metrics = 3; }
message ArrayRecord { string type_tag = 1; map<string, BatchedTensor> fields = 2;
  int64 num_datums = 3; }
message BatchedTensor { bytes data = 1; bytes offsets = 2; DType dtype = 3;
  repeated int64 trailing_shape = 4; }
message SampleResponse { repeated SampledSequence sequences = 1; optional bytes prompt_logprobs = 2;
  optional TopkLogprobs topk_prompt_logprobs = 3; int32 prompt_cache_hit_tokens = 4;
  optional Tensor target_prompt_logprobs = 5; optional PromptAltTokens prompt_alt_tokens = 6; }
message PromptAltTokens { Tensor tokens = 1; Tensor logprobs = 2; }
message SampledSequence { StopReason stop_reason = 1; bytes tokens = 2; optional bytes logprobs = 3;
  optional TopkLogprobs topk_sampled_logprobs = 4; }
message TopkLogprobs { bytes token_ids = 1; bytes logprobs = 2; uint32 k = 3; uint32 length = 4; }
"""
_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"bytes": 12, "string": 9, "double": 1, "int32": 5, "int64": 3, "uint32": 13, "bool": 8}
_TOKENS = re.compile(r"map<\s*string\s*,\s*(\w+)\s*>|\w+|[{};=]")


def _set_type(field: Any, kind: str, enums: set[str]) -> None:
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = _F.TYPE_ENUM if kind in enums else _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{kind}"


def file_descriptor(schema: str = SCHEMA) -> descriptor_pb2.FileDescriptorProto:
    """``schema`` as a FileDescriptorProto, laid out as protoc lays it out (maps as nested
    ``<Name>Entry`` messages, proto3 ``optional`` as a synthetic oneof ``_<field>``)."""
    words = [f"map:{m[1]}" if m[1] else m[0] for m in _TOKENS.finditer(schema)]
    enums = {words[i + 1] for i, word in enumerate(words) if word == "enum"}
    file = descriptor_pb2.FileDescriptorProto(
        name="grpo/tinker_public.proto", package=PACKAGE, syntax="proto3"
    )
    pos = 0
    while pos < len(words):
        kind, name = words[pos], words[pos + 1]
        pos += 3  # past "{"
        if kind == "enum":
            enum = file.enum_type.add(name=name)
            while words[pos] != "}":  # NAME = N ;
                enum.value.add(name=words[pos], number=int(words[pos + 2]))
                pos += 4
            pos += 1
            continue
        message, oneof = file.message_type.add(name=name), -1
        while words[pos] != "}" or oneof >= 0:
            if words[pos] == "}":  # the end of a oneof
                oneof, pos = -1, pos + 1
                continue
            if words[pos] == "oneof":
                oneof = len(message.oneof_decl)
                message.oneof_decl.add(name=words[pos + 1])
                pos += 3
                continue
            label = words[pos] if words[pos] in ("repeated", "optional") else ""
            pos += bool(label)
            kind, field_name, number = words[pos], words[pos + 1], int(words[pos + 3])
            pos += 5  # TYPE NAME = N ;
            field = message.field.add(name=field_name, number=number, label=_F.LABEL_OPTIONAL)
            if kind.startswith("map:"):
                entry = message.nested_type.add(
                    name="".join(p.capitalize() for p in field_name.split("_")) + "Entry"
                )
                entry.options.map_entry = True
                _set_type(entry.field.add(name="key", number=1, label=1), "string", enums)
                _set_type(entry.field.add(name="value", number=2, label=1), kind[4:], enums)
                field.type, field.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{name}.{entry.name}"
                label = "repeated"
            else:
                _set_type(field, kind, enums)
            if label == "repeated":
                field.label = _F.LABEL_REPEATED
            elif label == "optional":
                field.proto3_optional, field.oneof_index = True, len(message.oneof_decl)
                message.oneof_decl.add(name=f"_{field_name}")
            elif oneof >= 0:
                field.oneof_index = oneof
        pos += 1
    return file


_FILE = file_descriptor()
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_FILE)


def descriptor(name: str) -> Descriptor:
    """The descriptor of message ``name`` (e.g. "Datum")."""
    return _POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")


# The message classes by name. Typed Any: made at run time, no stub names their fields.
MESSAGES: dict[str, Any] = {
    message.name: message_factory.GetMessageClass(descriptor(message.name))
    for message in _FILE.message_type
}
ForwardBackwardRequestPb: Any = MESSAGES["ForwardBackwardRequest"]
ForwardBackwardOutputPb: Any = MESSAGES["ForwardBackwardOutput"]
SampleResponsePb: Any = MESSAGES["SampleResponse"]
DTYPE_NAMES = {v.number: v.name for v in _POOL.FindEnumTypeByName(f"{PACKAGE}.DType").values}

# array type codes: int32 ("i"), int64 ("q"), float32 ("f").
ITEMSIZE = {"i": 4, "q": 8, "f": 4}
assert all(array(code).itemsize == size for code, size in ITEMSIZE.items())
_BIG_ENDIAN = sys.byteorder == "big"


def pack(code: str, values: Iterable[float]) -> bytes:
    """``values`` as a little-endian array of type ``code``."""
    packed = array(code, values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack(code: str, raw: bytes) -> list[Any]:
    """The values of a little-endian array of type ``code`` (``len(raw)`` a multiple of its
    item size)."""
    values = array(code)
    values.frombytes(raw)
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tolist()
