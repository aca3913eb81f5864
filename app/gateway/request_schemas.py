"""The bodies of POST /v1/chat/completions and /v1/completions, in OpenAI's shapes (so the
`openai` SDK's requests validate unchanged), every field bounded.

What is accepted is an allow-list: OpenAI's sampling fields, plus vLLM's `top_k`, `min_p`,
`repetition_penalty` and `ignore_eos`; for chat, OpenAI's function `tools` (each validated as a
job's tool is, jobspec.agents.ToolFunction), `tool_choice` `none` or `auto`, assistant
messages with `tool_calls` and `tool` messages (app.gateway.chat_as_trained writes them as
training did). Any other field is a 400 naming it (`extra="forbid"`), as OpenAI answers an
unrecognized argument. vLLM's `prompt_logprobs` is parsed only to be refused
with its reason (app.gateway.engine_limits: what the engine cannot serve safely). The
operator's bounds (`GRPO_INFERENCE_MAX_TOKENS`, `_MAX_CHOICES`, `_MAX_PROMPT_CHARS`) are checked
by :func:`check_bounds` (they are settings, not constants). The model's context is the engine's
to check: vLLM answers 400, which the gateway passes on.

Text the engine would get is refused when it holds a NUL character (`param` names the field).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag

from app.core.errors import InvalidRequest
from app.gateway.request_parts import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_TOKEN_ID,
    MAX_TOOLS,
    Message,
    Name,
    NamedToolChoice,
    ResponseFormat,
    Stop,
    StreamOptions,
    Strict,
    Text,
    TokenId,
    Tool,
    UnsupportedParameter,
    no_control_characters,
    union_member,
)
from app.gateway.schemas import MAX_MODEL_NAME


class _Sampling(Strict):
    """The fields both endpoints share."""

    model: Annotated[
        str, Field(min_length=1, max_length=MAX_MODEL_NAME), AfterValidator(no_control_characters)
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
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def prompt_chars(self) -> int:
        tools = sum(tool.chars() for tool in self.tools or ())
        return sum(m.chars() for m in self.messages) + tools

    @property
    def has_tool_turns(self) -> bool:
        """Whether the conversation holds tool calls or tool results."""
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def reads_tool_calls(self) -> bool:
        """Whether the answer's tool calls are read out of its text (tools the model may call)."""
        return bool(self.tools) and self.tool_choice != "none"

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
    Discriminator(union_member),
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None

    def new_tokens(self) -> int:
        # Left out (or null), the gateway leaves it to the engine: OpenAI's default.
        return self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS

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
    if isinstance(body, ChatCompletionRequest):
        _check_tools(body)


def _check_tools(body: ChatCompletionRequest) -> None:
    """What of OpenAI's tool calling is not served, each an UnsupportedParameter naming it."""
    choice = body.tool_choice
    if choice is not None and choice not in ("none", "auto"):
        asked = repr(choice) if isinstance(choice, str) else "a named function"
        raise UnsupportedParameter(
            f"tool_choice {asked} is not served: the model decides whether to call a tool "
            "(its calls are read from its answer, as in training); use 'auto' or 'none'",
            param="tool_choice",
        )
    if body.stream and body.reads_tool_calls:
        raise UnsupportedParameter(
            "a streamed answer with tools is not served: its tool calls are read from the "
            "whole answer; ask without stream, or with tool_choice 'none'",
            param="stream",
        )
