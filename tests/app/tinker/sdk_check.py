"""Run by tests/app/tinker/test_wire_sdk.py with the official SDK's interpreter (.venv-tinker),
never imported by the project: reads JSON from stdin, answers JSON on stdout.

Input: ``fwdbwd`` (hex ForwardBackwardOutput bodies, one per chunk of one call), ``sample``
({"hex", "ids"}), ``responses`` ({"SdkTypeName": [json bodies]}). Output: what the SDK made of
each, as its users would see it (chunks combined as the SDK combines them), and "ok" or the
validation error for each JSON reply.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from typing import Any

from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids
from tinker.proto.response_conv import deserialize_proto_response

EXTRA_TYPES = {
    "TryAgainResponse": "tinker.types.try_again_response",
    "UntypedAPIFuture": "tinker.types.shared.untyped_api_future",
}


def sdk_type(name: str) -> Any:
    if name in EXTRA_TYPES:
        return getattr(importlib.import_module(EXTRA_TYPES[name]), name)
    return getattr(types, name)


def main() -> None:
    given = json.load(sys.stdin)
    out: dict[str, Any] = {}
    if "fwdbwd" in given:
        chunks = [
            deserialize_proto_response(bytes.fromhex(h), types.ForwardBackwardOutput)
            for h in given["fwdbwd"]
        ]
        combined = combine_fwd_bwd_output_results(chunks)
        out["fwdbwd"] = {
            "loss_fn_output_type": combined.loss_fn_output_type,
            "metrics": combined.metrics,
            "logprobs": [
                {
                    "dtype": o["logprobs"].dtype,
                    "shape": o["logprobs"].shape,
                    "data": o["logprobs"].data,
                }
                for o in combined.loss_fn_outputs
            ],
        }
    if "sample" in given:
        response = deserialize_proto_response(
            bytes.fromhex(given["sample"]["hex"]), types.SampleResponse
        )
        response = _attach_sequence_ids(response, given["sample"]["ids"])
        out["sample"] = {
            "sequences": [
                {
                    "tokens": list(s.tokens),
                    "logprobs": s.logprobs,
                    "stop_reason": s.stop_reason,
                    "sequence_id": s.sequence_id,
                }
                for s in response.sequences
            ],
            "prompt_logprobs": [
                None if v is None or (isinstance(v, float) and math.isnan(v)) else v
                for v in (response.prompt_logprobs or [])
            ],
        }
    out["responses"] = {}
    for name, bodies in given.get("responses", {}).items():
        results = []
        for body in bodies:
            try:
                sdk_type(name).model_validate(body)
                results.append("ok")
            except Exception as exc:
                results.append(f"{type(exc).__name__}: {exc}")
        out["responses"][name] = results
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
