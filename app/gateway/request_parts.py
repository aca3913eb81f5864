"""The parts of a chat or completion request's body (app.gateway.request_schemas), each
bounded: text (no NUL), messages (with the tool calls of an assistant turn and the `tool` turns
that answer them), function tools (validated as a job's tools are,
jobspec.agents.ToolFunction), stop sequences and response formats."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from app.core.errors import InvalidRequest
from app.gateway.schemas import holds_control_characters
from jobspec.agents import ToolFunction

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
MAX_TOOLS = 128  # function tools of one request
MAX_TOOL_CALLS = 128  # calls of one assistant message of the conversation
# vLLM's default max_tokens of a completion that sets none (OpenAI's), which the gateway keeps.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class UnsupportedParameter(InvalidRequest):
    """A request field (or combination) this service does not serve (OpenAI's code)."""

    code = "unsupported_parameter"


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters (\\u0000)")
    return value


def no_control_characters(value: str) -> str:
    """A model name is printable: a trailing newline must not pass for the name without it."""
    if holds_control_characters(value):
        raise ValueError("must not contain control characters (a newline, a tab, NUL, ...)")
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_no_nul)]
Name = Annotated[str, Field(max_length=256), AfterValidator(_no_nul)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: Text


def union_member(value: Any) -> str:
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
    ]
    # None inside the union (an assistant turn holding only tool calls), as for Stop below.
    | Annotated[None, Tag("none")],
    Discriminator(union_member),
]


class CalledFunction(Strict):
    name: Name
    arguments: Text  # JSON text, as the model wrote it (chat_as_trained reads it)


class ToolCallMessage(Strict):
    """One call of an assistant turn, as an answer gave it (OpenAI's shape)."""

    id: Name
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: Annotated[list[ToolCallMessage], Field(max_length=MAX_TOOL_CALLS)] | None = None
    # After tool_calls, which its check reads.
    content: Content = Field(default=None, validate_default=True)
    name: Name | None = None
    tool_call_id: Name | None = None
    # The rest of an answer's message, which the openai SDK sends back as it got it when an
    # agent appends the answer to its conversation: accepted when empty, as vLLM leaves them,
    # and not forwarded.
    refusal: None = Field(default=None, exclude=True)
    annotations: None = Field(default=None, exclude=True)
    audio: None = Field(default=None, exclude=True)
    function_call: None = Field(default=None, exclude=True)
    reasoning: None = Field(default=None, exclude=True)  # vLLM's own

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(
        cls, value: list[ToolCallMessage] | None, info: ValidationInfo
    ) -> list[ToolCallMessage] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("tool_calls is only allowed in an assistant message")
        return value

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not info.data.get("tool_calls"):
            raise ValueError("is required, unless an assistant message has tool_calls")
        return value

    def chars(self) -> int:
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        if self.content is None:
            return calls
        if isinstance(self.content, str):
            return len(self.content) + calls
        return sum(len(part.text) for part in self.content) + calls


class Tool(Strict):
    """A function the model may call, validated as a job's tool is (its name, its description,
    its bounded object schema, no NUL anywhere), so it is written in the shape training wrote
    tools in."""

    type: Literal["function"]
    function: ToolFunction

    def chars(self) -> int:
        """Its size in the prompt, about: its description as JSON."""
        return len(json.dumps(self.function.model_dump(exclude_none=True)))


class NamedToolChoice(Strict):
    """OpenAI's "call this function": parsed to be refused with its reason (check_bounds)."""

    type: Literal["function"]
    function: dict[Literal["name"], Name]


class StreamOptions(Strict):
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


class JsonSchema(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Name | None = None
    # `schema` is the field's name on the wire; pydantic's BaseModel has a `schema` method.
    json_schema: Annotated[dict[str, Any], AfterValidator(_json_without_nul)] = Field(
        alias="schema"
    )
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Strict):
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
    Discriminator(union_member),
]
