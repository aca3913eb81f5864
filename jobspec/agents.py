"""The agent sections of the job spec: ``tools``, ``environment`` and the per-episode budgets
(``episode``). A job with neither tools nor an environment samples one completion per prompt,
as before; with either, every completion is an episode of several turns (``trainer.agents``).

A tool is OpenAI's function-tool shape (``{type: function, function: {name, description,
parameters}}``) plus an ``implementation``: ``python`` source run in the worker's grader sandbox,
or ``http``, an endpoint the operator registered, named like the judge endpoints (a job never
carries a URL: a ``url`` field anywhere in a tool or an environment is refused naming the field,
and so is a remote ``$ref``/``$id`` in a parameters schema).
"""

from __future__ import annotations

import ast
import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from grading.endpoints import ENDPOINT_NAME_PATTERN
from grading.python_source import parse_source
from specbase import StrictModel

__all__ = [
    "MAX_TOOLS",
    "EnvironmentSpec",
    "EpisodeSpec",
    "HttpEnvironment",
    "HttpToolImplementation",
    "PythonEnvironment",
    "PythonToolImplementation",
    "ToolFunction",
    "ToolImplementation",
    "ToolSpec",
]

MAX_TOOLS = 16
MAX_AGENT_SOURCE_CHARS = 64_000
MAX_PARAMETERS_CHARS = 16_000  # the schema as compact JSON
MAX_PARAMETERS_DEPTH = 12
_NO_URL = (
    "a job never carries a URL: name an endpoint the operator registered "
    "(implementation {type: http, endpoint: NAME})"
)


def _refuse_url(value: object) -> None:
    if value is not None:
        raise ValueError(_NO_URL)
    return None


# A field that exists only to be refused with a message that says why (its loc is the field's).
_UrlRefused = SkipJsonSchema[Any]


class _NoUrl(StrictModel):
    """A part of a tool or an environment: ``url`` is refused naming itself, not as an unknown
    field, so the 422 says what to do instead."""

    url: _UrlRefused = Field(default=None, exclude=True)

    _no_url = field_validator("url", mode="before")(_refuse_url)


def _defines(source: str, kind: type[ast.AST], name: str, what: str) -> str:
    tree = parse_source(source, "tool.py")
    names = {getattr(node, "name", None) for node in tree.body if isinstance(node, kind)}
    if name not in names:
        raise ValueError(f"source must define {what}")
    return source


class PythonToolImplementation(_NoUrl):
    """``source`` defines a function named like the tool, called with the call's arguments as
    keywords in the worker's grader sandbox (its limits; the call's time limit is
    ``episode.tool_timeout_s``). Its return value (a string, or JSON-serialisable) is the tool
    result the model reads; an exception is a tool error the model reads too."""

    type: Literal["python"]
    source: str = Field(
        min_length=1, max_length=MAX_AGENT_SOURCE_CHARS, description="Python source."
    )


class HttpToolImplementation(_NoUrl):
    """The tool runs on an endpoint the operator registered (its address and key stay in the
    worker's settings); the job names it."""

    type: Literal["http"]
    endpoint: str = Field(
        pattern=ENDPOINT_NAME_PATTERN, description="The operator's tool endpoint to call."
    )


ToolImplementation = Annotated[
    PythonToolImplementation | HttpToolImplementation, Field(discriminator="type")
]


def _schema_problem(schema: Any, path: str, depth: int) -> str | None:
    """Why ``schema`` (a JSON schema, walked) may not be sent, or None: too deep, or a remote
    reference (a URL the worker would be asked to resolve)."""
    if depth > MAX_PARAMETERS_DEPTH:
        return f"{path}: nested deeper than {MAX_PARAMETERS_DEPTH} levels"
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("$ref", "$id", "$dynamicRef") and not str(value).startswith("#"):
                return f"{path}.{key}: only local references (#/...) are allowed; {_NO_URL}"
            problem = _schema_problem(value, f"{path}.{key}", depth + 1)
            if problem:
                return problem
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            problem = _schema_problem(value, f"{path}[{i}]", depth + 1)
            if problem:
                return problem
    return None


class ToolFunction(_NoUrl):
    """OpenAI's function description: what the model reads about the tool."""

    name: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description="The function name the model calls (a Python identifier).",
    )
    description: str = Field(default="", max_length=4000, description="What the tool does.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description=(
            "JSON schema of the arguments (an object schema; at most "
            f"{MAX_PARAMETERS_CHARS} characters as JSON, {MAX_PARAMETERS_DEPTH} levels deep)."
        ),
    )
    strict: bool | None = Field(default=None, description="Accepted for OpenAI compatibility.")

    @field_validator("parameters")
    @classmethod
    def _bounded_object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type", "object") != "object":
            raise ValueError("parameters must be an object schema (type: object)")
        if len(json.dumps(schema, separators=(",", ":"))) > MAX_PARAMETERS_CHARS:
            raise ValueError(f"parameters is over {MAX_PARAMETERS_CHARS} characters as JSON")
        problem = _schema_problem(schema, "parameters", 0)
        if problem:
            raise ValueError(problem)
        return schema


class ToolSpec(_NoUrl):
    """One tool: OpenAI's function tool plus how it runs."""

    type: Literal["function"] = Field(default="function", description="Always a function tool.")
    function: ToolFunction = Field(description="Name, description and argument schema.")
    implementation: ToolImplementation = Field(description="python source, or an http endpoint.")

    @model_validator(mode="after")
    def _source_defines_the_function(self) -> ToolSpec:
        impl = self.implementation
        if isinstance(impl, PythonToolImplementation):
            name = self.function.name
            _defines(impl.source, ast.FunctionDef, name, f"a function {name}(**arguments)")
        return self


class _EnvironmentBase(_NoUrl):
    weight: float = Field(
        default=1.0,
        ge=-100,
        le=100,
        description=(
            "Weight of the environment's reward (the sum of its steps' rewards over an episode) "
            "in the total reward, added like a grader's (metric reward/environment/mean)."
        ),
    )


class PythonEnvironment(_EnvironmentBase):
    """``source`` defines ``class_name`` with ``reset(item) -> messages`` and
    ``step(messages) -> {messages, reward, done}``, run in the grader sandbox."""

    type: Literal["python"]
    source: str = Field(
        min_length=1, max_length=MAX_AGENT_SOURCE_CHARS, description="Python source."
    )
    class_name: str = Field(
        default="Environment",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description="The class the source defines.",
    )

    @model_validator(mode="after")
    def _defines_the_class(self) -> PythonEnvironment:
        _defines(self.source, ast.ClassDef, self.class_name, f"a class {self.class_name}")
        return self


class HttpEnvironment(_EnvironmentBase):
    """The environment runs on an endpoint the operator registered: POST reset and step with an
    episode id, the same protocol as the python class."""

    type: Literal["http"]
    endpoint: str = Field(pattern=ENDPOINT_NAME_PATTERN, description="The operator's endpoint.")


EnvironmentSpec = Annotated[PythonEnvironment | HttpEnvironment, Field(discriminator="type")]


class EpisodeSpec(StrictModel):
    """Per-episode budgets; what ends an episode is recorded (``episode/end/<reason>``)."""

    max_turns: int = Field(
        default=4, ge=1, le=64, description="Assistant turns an episode may take."
    )
    max_tool_calls: int = Field(
        default=8, ge=0, le=256, description="Tool calls an episode may make, all turns."
    )
    tool_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="Wall-time limit of one tool or environment call."
    )
    max_episode_tokens: int = Field(
        default=4096,
        ge=16,
        le=32_768,
        description="Tokens of an episode, prompt and every turn (sampled and injected) together.",
    )
    on_template_drift: Literal["continue", "split", "drop"] = Field(
        default="continue",
        description=(
            "When the chat template re-renders the conversation so far differently from the "
            "tokens sampled (Llama-3's trim, Qwen3's think-block stripping): continue (the "
            "episode goes on from its own tokens, each turn's new messages appended as the "
            "template writes them, and all of it trains), split (the episode goes on from the "
            "new render as a second segment, which does not train: episode/"
            "sampled_left_out_frac) or drop (the episode ends and is not trained). Counted in "
            "episode/template_drift."
        ),
    )
