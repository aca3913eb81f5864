"""Forwarding a chat or completion request to the vLLM OpenAI server that has the weights, and
reading its answer back in the client's terms.

- The body is the client's, validated (app.gateway.request_schemas), with `model` replaced by
  the name the engine serves it under (:func:`upstream_body`).
- A chat to a model trained with a system prompt or few-shot turns, or one with tools or tool
  turns, is written as training wrote prompts (app.gateway.chat_as_trained, by the engine's
  chat-template traits, which its ensure answer carries).
- A chat that sets no `max_tokens` is sent min(GRPO_INFERENCE_MAX_TOKENS, the engine's
  context): vLLM then generates at most the context left after the prompt (it clamps to it),
  and never more than the bound the request was admitted and budgeted under. A completion that
  sets none keeps OpenAI's default, 16, which vLLM applies.
- A stream always asks for usage on every chunk
  (`stream_options.include_usage` and vLLM's `continuous_usage_stats`), so the gateway knows
  what the engine did even when the client leaves mid-stream; the usage is dropped again from
  the chunks, and the final usage chunk unless the client asked for it.
- Every `model` field of the answer, and of each chunk, is the client's name again (a
  non-streamed answer: app.gateway.answer).
- The engine's 4xx (a prompt past the model's context, a schema it cannot compile) becomes the
  same status with OpenAI's error body, its message kept and its `param` named as the client's
  request names it (:func:`client_param`); a 5xx, a dropped connection or a timeout is a 502 or
  504 (a 503 while the engine is down: app.gateway.stream).

The SSE relay (:class:`SseRelay`) works event by event, never holding more than one event:
each is parsed, rewritten and handed on as it arrives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from app.core.errors import ApiError, UpstreamFailed, UpstreamRefused
from app.gateway import chat_as_trained
from app.gateway.chat_as_trained import TrainedPrompt
from app.gateway.protocol import EnsureResponse
from app.gateway.request_parts import UnsupportedParameter
from app.gateway.request_schemas import ChatCompletionRequest, InferenceRequest
from jobspec.prompt_format import TemplateTraits

Endpoint = Literal["chat/completions", "completions"]

# vLLM's names, in its refusals, for what the client sent as the prompt (`messages` or
# `prompt`): its token and character counts, and the parts of a message.
_PROMPT_PARAMS = frozenset(
    {"input_tokens", "input_text", "prompt_tokens", "prompt_embeds", "type", "tool_calls"}
)
_FIELD_HEAD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*")
_PARAM_IN_MESSAGE = re.compile(r"\s*\(parameter=[^)]*\)\s*$")
MAX_ERROR_BYTES = 64 * 1024
# Traits for a chat without tools or tool turns, which reads none of them.
NO_TOOLS = TemplateTraits(native_tools=False, tool_role=False)


def endpoint_of(body: InferenceRequest) -> Endpoint:
    return "chat/completions" if isinstance(body, ChatCompletionRequest) else "completions"


def prompt_field(body: InferenceRequest) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def upstream_body(
    body: InferenceRequest,
    target: EnsureResponse,
    *,
    prompt: TrainedPrompt | None,
    max_tokens: int,
) -> dict[str, Any]:
    """What is sent to the engine `target`: the fields the client set, `model` replaced, a chat
    written as the model was trained (`prompt`: its job's prompt settings) with its tokens
    bounded by `max_tokens` (GRPO_INFERENCE_MAX_TOKENS) when it sets none; a stream asks for
    usage. UnsupportedParameter for tools the engine's traits are not known for."""
    data = body.model_dump(mode="json", exclude_unset=True, by_alias=True)
    data["model"] = target.served_model
    if isinstance(body, ChatCompletionRequest):
        data = _as_trained(body, data, prompt, target.chat_traits)
        if body.new_tokens() is None and target.max_model_len is not None:
            data["max_tokens"] = min(max_tokens, target.max_model_len)
    elif body.max_tokens is None:
        data.pop("max_tokens", None)  # null: OpenAI's default, which the engine applies
    if body.stream:
        options = data.get("stream_options") or {}
        data["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return data


def _as_trained(
    body: ChatCompletionRequest,
    data: dict[str, Any],
    prompt: TrainedPrompt | None,
    traits: TemplateTraits | None,
) -> dict[str, Any]:
    """The chat's body as training wrote prompts, when it needs writing: the model was trained
    with a system prompt or few-shot turns, or the request has tools or tool turns (which need
    the engine's traits). Otherwise the client's messages, untouched."""
    trained = prompt is not None and bool(prompt.system_prompt or prompt.few_shot)
    with_tools = bool(body.tools) or body.has_tool_turns
    if not body.tools:
        data.pop("tool_choice", None)  # vLLM would want its own tool parser for "auto"
    if not (trained or with_tools):
        return data
    if with_tools and traits is None:
        raise UnsupportedParameter(
            "the inference process serving this model did not say how its chat template "
            "takes tools (an older `grpo inference`, or its probe failed), so tools and tool "
            "turns cannot be written as in training; ask without them",
            param="tools" if body.tools else "messages",
        )
    return chat_as_trained.render_messages(data, prompt or TrainedPrompt(), traits or NO_TOOLS)


def client_param(raw: object, body: InferenceRequest) -> str | None:
    """The engine's `param` as the client's request names it: a field of the request (or a
    path under one) is kept, vLLM's names for the prompt are the prompt's field, anything else
    (vLLM's internals) is dropped."""
    if not isinstance(raw, str) or not raw:
        return None
    if raw in _PROMPT_PARAMS:
        return prompt_field(body)
    head = _FIELD_HEAD.match(raw)
    fields = type(body).model_fields
    return raw[:200] if head is not None and head.group() in fields else None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, data: Any) -> Usage | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                max(0, int(data.get("prompt_tokens") or 0)),
                max(0, int(data.get("completion_tokens") or 0)),
            )
        except (TypeError, ValueError):
            return None


def rewrite_answer(data: Any, client_model: str) -> Any:
    """A JSON answer (or chunk) with `model` set back to the client's name."""
    if isinstance(data, dict) and "model" in data:
        data["model"] = client_model
    return data


def upstream_error(
    status: int, content: bytes, *, body: InferenceRequest, served_model: str
) -> ApiError:
    """The engine's error answer as the client's: a 4xx keeps its status and message, its
    param named as the client's request names it (:func:`client_param`); anything else is a
    502."""
    message, param = "", None
    try:
        data = json.loads(content[:MAX_ERROR_BYTES])
        error = data.get("error", data) if isinstance(data, dict) else {}
        if isinstance(error, dict):
            message = str(error.get("message") or "")
            param = client_param(error.get("param"), body)
    except ValueError:
        message = content[:2000].decode("utf-8", "replace")
    message = message.replace(served_model, body.model)[:4000] if served_model else message
    if 400 <= status < 500 and status not in (401, 403, 408, 429):
        if param is None and "context length" in message:
            param = prompt_field(body)
        return UpstreamRefused(
            _PARAM_IN_MESSAGE.sub("", message) or f"the inference engine refused it ({status})",
            status_code=status,
            param=param,
        )
    return UpstreamFailed(
        f"the inference engine failed ({status}): {message[:500] or 'no detail'}; retry later"
    )


class RunningUsage:
    """What the engine has done for a stream so far, from vLLM's per-chunk usage
    (`continuous_usage_stats`), which counts per choice: its completion tokens so far, and its
    prompt's tokens (choice `i` answers prompt `i // n`). The final usage chunk, when it comes,
    is the whole request's and wins."""

    def __init__(self, choices_per_prompt: int) -> None:
        self.choices_per_prompt = max(1, choices_per_prompt)
        self.final: Usage | None = None
        self._prompt: dict[int, int] = {}  # prompt index -> its tokens
        self._completion: dict[int, int] = {}  # choice index -> its tokens so far

    def see(self, usage: Usage, choices: list[Any]) -> None:
        if not choices:
            self.final = usage
            return
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            index = index if isinstance(index, int) and index >= 0 else 0
            self._prompt[index // self.choices_per_prompt] = usage.prompt_tokens
            self._completion[index] = usage.completion_tokens

    def total(self) -> Usage | None:
        if self.final is not None:
            return self.final
        if not self._completion:
            return None
        return Usage(sum(self._prompt.values()), sum(self._completion.values()))


class SseRelay:
    """Feeds on the engine's SSE bytes and gives back the client's: each `data:` event with
    `model` rewritten and the engine's running usage taken out; the usage chunk (no choices)
    kept only when the client asked for it; `data: [DONE]` as it comes. Keeps the engine's
    running usage (:class:`RunningUsage`), so a stream left early is charged what the engine
    reported up to then; content chunks are counted for an engine that sent none."""

    def __init__(self, client_model: str, *, include_usage: bool, choices_per_prompt: int) -> None:
        self.client_model = client_model
        self.include_usage = include_usage
        self.usage = RunningUsage(choices_per_prompt)
        self.chunks = 0
        self.done = False
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return out
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            relayed = self._event(event)
            if relayed is not None:
                out.append(relayed)

    def _event(self, event: bytes) -> bytes | None:
        lines = event.replace(b"\r\n", b"\n").split(b"\n")
        payload = b"\n".join(
            line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")
        ).strip()
        if not payload:
            return None  # comments and keep-alives carry nothing for the client
        if payload == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(payload)
        except ValueError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(chunk, dict):
            return b"data: " + payload + b"\n\n"
        choices = chunk.get("choices")
        choices = choices if isinstance(choices, list) else []
        usage = Usage.of(chunk.get("usage"))
        if usage is not None:
            self.usage.see(usage, choices)
        if usage is not None and not choices and not self.include_usage:
            return None
        if choices:
            self.chunks += 1
            chunk.pop("usage", None)  # the running count the gateway asked for, not the client
        rewrite_answer(chunk, self.client_model)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def estimated_usage(self) -> Usage:
        """The engine's usage so far; else the content chunks received as completion tokens
        (vLLM sends about one a token) and no prompt tokens."""
        return self.usage.total() or Usage(0, self.chunks)


def completion_url(base_url: str, endpoint: Endpoint) -> str:
    return f"{base_url.rstrip('/')}/v1/{endpoint}"


def timeouts(read_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=5.0, read=read_s, write=30.0, pool=5.0)
