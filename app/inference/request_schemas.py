"""The bodies of POST /v1/chat/completions and /v1/completions, in OpenAI's shapes (so the
`openai` SDK's requests validate unchanged), every field bounded.

What is accepted is an allow-list: OpenAI's sampling fields, plus vLLM's `top_k`, `min_p`,
`repetition_penalty` and `ignore_eos`. Any other field is a 400 naming it (`extra="forbid"`), as
OpenAI answers an unrecognized argument. vLLM's `prompt_logprobs` is parsed only to be refused
with its reason (app.inference.engine_limits: what the engine cannot serve safely). The
operator's bounds (`GRPO_INFERENCE_MAX_TOKENS`, `_MAX_CHOICES`, `_MAX_PROMPT_CHARS`) are checked
by :func:`check_bounds` (they are settings, not constants). The model's context is the engine's
to check: vLLM answers 400, which the gateway passes on.

Text the engine would get is refused when it holds a NUL character (`param` names the field).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from app.core.errors import InvalidRequest
from app.inference.schemas import MAX_MODEL_NAME, holds_control_characters

MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_PROMPTS = 256
MAX_SCHEMA_BYTES = 64 * 1024
MAX_LOGIT_BIAS = 300
MAX_TOKEN_ID = 2**31 - 1
# Characters of one string field (a message's content is also counted in the request's total).
MAX_TEXT = 4 * 1024 * 1024


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return value


def _no_control(value: str) -> str:
    """A model name is printable: a trailing newline must not pass for the name without it."""
    if holds_control_characters(value):
        raise ValueError("must not contain control characters (a newline, a tab, NUL, ...)")
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_no_nul)]
Name = Annotated[str, Field(max_length=256), AfterValidator(_no_nul)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


def _shape(value: Any) -> str:
    """The union member a value is meant for, so that an error names that member's problem (a
    NUL in a part's text), not every member's; the tags are the labels app.core.field_paths
    leaves out of a `param`."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "list[list[int]]"
    if isinstance(value, list) and value and isinstance(value[0], int):
        return "list[int]"
    return "list[parts]"


Content = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[
        list[TextPart],
        Field(min_length=1, max_length=MAX_CONTENT_PARTS),
        Tag("list[parts]"),
    ],
    Discriminator(_shape),
]


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    name: Name | None = None
    tool_call_id: Name | None = None

    def chars(self) -> int:
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(part.text) for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


def _json_without_nul(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema is free JSON: bounded by its encoded size, NUL-free anywhere, and with
    finite numbers only (JSON has no NaN or Infinity; the engine would refuse the body)."""
    try:
        encoded = json.dumps(value, allow_nan=False)  # escapes NUL as \\u0000
    except ValueError:
        raise ValueError("must hold finite numbers only (no NaN or Infinity)") from None
    if len(encoded) > MAX_SCHEMA_BYTES:
        raise ValueError(f"is larger than {MAX_SCHEMA_BYTES} bytes as JSON")
    if "\\u0000" in encoded:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return value


class JsonSchema(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Name | None = None
    # `schema` is the field's name on the wire; pydantic's BaseModel has a `schema` method.
    json_schema: Annotated[dict[str, Any], AfterValidator(_json_without_nul)] = Field(
        alias="schema"
    )
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


Stop = Annotated[
    Annotated[Name, Tag("str")]
    | Annotated[
        list[Annotated[Name, Field(max_length=MAX_STOP_CHARS)]],
        Field(max_length=MAX_STOP),
        Tag("list[parts]"),
    ]
    # None inside the union: a discriminated union made optional from outside loses its tags.
    | Annotated[None, Tag("none")],
    Discriminator(_shape),
]


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: Annotated[
        str, Field(min_length=1, max_length=MAX_MODEL_NAME), AfterValidator(_no_control)
    ]
    n: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: Stop = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=16, pattern=r"^\d+$")],
                Annotated[float, Field(ge=-100, le=100)],
            ],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: Name | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters.
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool | None = None  # generate max_tokens whatever the model says (benchmarks)
    # vLLM's log-probabilities of the prompt: parsed to be refused (engine_limits.HAZARDS).
    prompt_logprobs: Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)] | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def wants_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def choices(self) -> int:
        return self.n or 1

    def prompt_chars(self) -> int:
        raise NotImplementedError

    def token_fields(self) -> dict[str, int | None]:
        return {"max_tokens": self.max_tokens}

    def new_tokens(self) -> int | None:
        """The most tokens each choice may generate, as asked (None: up to the context)."""
        return self.max_tokens

    def work(self, default_new_tokens: int) -> int:
        """The work the request asks of the engine, in tokens: every choice's new tokens
        (`default_new_tokens` when not asked) plus the prompt's characters, each at least a
        token's worth (a token id counts one)."""
        return self.choices() * (self.new_tokens() or default_new_tokens) + self.prompt_chars()

    @property
    def wants_json(self) -> bool:
        fmt = self.response_format
        return fmt is not None and fmt.type != "text"


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def prompt_chars(self) -> int:
        return sum(m.chars() for m in self.messages)

    def token_fields(self) -> dict[str, int | None]:
        return {"max_tokens": self.max_tokens, "max_completion_tokens": self.max_completion_tokens}

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens  # vLLM's precedence


Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("list[parts]")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("list[int]")]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_PROMPTS),
        Tag("list[list[int]]"),
    ],
    Discriminator(_shape),
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None

    def prompts(self) -> int:
        """How many prompts the request holds (each gets `n` choices)."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return 1
        return len(prompt)

    def choices(self) -> int:
        return (self.n or 1) * self.prompts()

    def prompt_chars(self) -> int:
        prompt = self.prompt
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


InferenceRequest = ChatCompletionRequest | CompletionRequest


def check_bounds(
    body: InferenceRequest, *, max_tokens: int, max_choices: int, max_prompt_chars: int
) -> None:
    """The operator's bounds, each refusal an InvalidRequest (400 on these paths) naming the
    field and the setting."""
    for field, value in body.token_fields().items():
        if value is not None and value > max_tokens:
            raise InvalidRequest(
                f"{field} is {value}, more than this service's limit of {max_tokens} "
                "(GRPO_INFERENCE_MAX_TOKENS)",
                param=field,
            )
    if body.choices() > max_choices:
        what = (
            "n"
            if isinstance(body, ChatCompletionRequest) or body.prompts() == 1
            else ("n x prompts")
        )
        raise InvalidRequest(
            f"{what} asks for {body.choices()} choices, more than this service's limit of "
            f"{max_choices} (GRPO_INFERENCE_MAX_CHOICES)",
            param="n",
        )
    chars = body.prompt_chars()
    if chars > max_prompt_chars:
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"{field} holds {chars} characters, more than this service's limit of "
            f"{max_prompt_chars} (GRPO_INFERENCE_MAX_PROMPT_CHARS)",
            param=field,
        )
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    fmt = body.response_format
    if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
        raise InvalidRequest(
            "response_format.json_schema is required with type json_schema, and only with it",
            param="response_format.json_schema",
        )
