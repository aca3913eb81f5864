"""Issue 32, item 2: a chat request with `tools` to a model trained here is written as its
training wrote prompts (app.gateway.chat_as_trained over jobspec.prompt_format), and the
tool calls of its answer come back in OpenAI's shape.

Checked against the trainer itself, with a real tokenizer (the tiny packaged model's) under three
kinds of chat template: its own (no `tools=`, renders a `tool` turn), a Qwen2.5-like one that
renders `tools=` itself, and one that refuses any role but system, user and assistant. The
trainer's rollout renders an episode (the job's system prompt and few-shot turns, the row's
question, the model's call, the tool's result) with trainer.agents.chat; the served side renders
the same exchange from an OpenAI request (structured `tool_calls`, a `tool` message answering
the call by id), and the chat template is applied as vLLM's server applies it. The token ids
must be equal."""

from __future__ import annotations

import json
from dataclasses import astuple
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.gateway.chat_as_trained import TrainedPrompt, render_messages, with_tool_calls
from jobspec.prompt_format import (
    TemplateTraits,
    conversation,
    hermes_call_text,
    parse_hermes,
)
from tests.trainer.agents.test_chat_and_parsing import (
    QWEN_LIKE,
    STRICT_ROLES,
    TOOLS,  # one multiply tool
    with_template,
)
from trainer.agents.chat import ChatFormat, chat_format
from trainer.agents.parsing import parse_hermes as trainer_parse
from trainer.data.dataset import conversation as trainer_conversation
from trainer.models.loading import resolve_model

SYSTEM_PROMPT = "You are a calculator."
FEW_SHOT = [
    {"role": "user", "content": "what is 2*3?"},
    {"role": "assistant", "content": "6"},
]
QUESTION = "what is 6*7?"
ARGUMENTS = {"a": 6, "b": 7}
RESULT = "42"


@pytest.fixture(scope="module")
def tiny() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model("tiny-random-llama"))


def trained_ids(
    fmt: ChatFormat,
    *,
    system_prompt: str | None = SYSTEM_PROMPT,
    few_shot: list[dict[str, str]] = FEW_SHOT,
) -> list[int]:
    """The episode's render after one tool call, as the trainer's rollout makes it (with the
    job's system prompt and few-shot turns, unless told otherwise)."""
    rows = trainer_conversation(QUESTION, system_prompt=system_prompt, few_shot=few_shot)
    messages = fmt.initial(rows)
    messages.append({"role": "assistant", "content": hermes_call_text("multiply", ARGUMENTS)})
    messages.append(fmt.tool_message("multiply", RESULT))
    return fmt.render(messages)


def served_body(traits: TemplateTraits) -> dict[str, Any]:
    """The same exchange as an OpenAI request, as the gateway sends it to the engine."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "multiply", "arguments": json.dumps(ARGUMENTS)},
    }
    body: dict[str, Any] = {
        "model": "ft:tiny-random-llama::job_x",
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
        ],
        "tools": TOOLS,
    }
    return render_messages(body, TrainedPrompt(SYSTEM_PROMPT, tuple(FEW_SHOT)), traits)


def _served(tokenizer: PreTrainedTokenizerBase, traits: TemplateTraits) -> list[int]:
    """The request rendered as vLLM's chat endpoint renders it (tests/inference/
    test_served_as_trained.py asks a real vLLM server)."""
    sent = served_body(traits)
    text = tokenizer.apply_chat_template(
        sent["messages"], tools=sent.get("tools"), tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("template", [None, QWEN_LIKE, STRICT_ROLES], ids=["own", "qwen", "strict"])
def test_a_chat_with_tools_renders_the_tokens_the_trainer_rendered(
    tiny: PreTrainedTokenizerBase, template: str | None
) -> None:
    tokenizer = tiny if template is None else with_template(tiny, template)
    fmt = chat_format(tokenizer, TOOLS)
    traits = TemplateTraits(
        native_tools=fmt.native_tools, tool_role=fmt.tool_role, family=fmt.family
    )
    assert _served(tokenizer, traits) == trained_ids(fmt)


def test_the_answers_tool_calls_come_back_in_openais_shape() -> None:
    text = f"Let me compute.\n{hermes_call_text('multiply', ARGUMENTS)}"
    answer: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "42"},
                "finish_reason": "stop",
            },
        ],
    }
    traits = TemplateTraits(native_tools=False, tool_role=True)
    called, plain = with_tool_calls(answer, traits)["choices"]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["content"] == "Let me compute."
    [call] = called["message"]["tool_calls"]
    assert (call["type"], call["function"]["name"]) == ("function", "multiply")
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS
    assert call["id"].startswith("call_") and len(call["id"]) > len("call_")
    assert plain == {
        "index": 1,
        "message": {"role": "assistant", "content": "42"},
        "finish_reason": "stop",
    }


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        '<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>',
        'a <tool_call>{"name": "m", "arguments": "{\\"a\\": 2}"}</tool_call> b <tool_call>c',
        "<tool_call>not json</tool_call><tool_call>[1]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call> tail',
        "<tool_call>" * 50,
    ],
)
def test_calls_are_read_as_the_trainer_reads_them(text: str) -> None:
    assert astuple(parse_hermes(text)) == astuple(trainer_parse(text))


@pytest.mark.parametrize(
    "prompt",
    [
        QUESTION,
        [{"role": "user", "content": QUESTION}],
        [{"role": "system", "content": "own"}, {"role": "user", "content": QUESTION}],
    ],
)
def test_the_conversation_is_the_one_training_sent(prompt: Any) -> None:
    for system_prompt in (None, SYSTEM_PROMPT):
        served = conversation(prompt, system_prompt=system_prompt, few_shot=FEW_SHOT)
        assert served == trainer_conversation(
            prompt, system_prompt=system_prompt, few_shot=FEW_SHOT
        )
