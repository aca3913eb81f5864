"""Tools reach the model through its template (or the default system prompt); tool calls are
parsed without ever raising; the token delta of a render is checked against what came before."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedTokenizerBase

from jobspec import DatasetSpec
from trainer.agents import (
    chat_format,
    default_tool_prompt,
    parse_hermes,
    parser_family,
    token_delta,
)
from trainer.agents.chat import TOOL_RESULT_PREFIX
from trainer.data.dataset import Example
from trainer.run.episodes import conversation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
# A Qwen2.5-style template: renders tools= in its system turn and tool turns as user turns.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{json}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that knows only user and assistant turns and refuses anything else.
STRICT_ROLES = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tokenizer: PreTrainedTokenizerBase, template: str) -> PreTrainedTokenizerBase:
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_smollm2_gets_the_default_tool_prompt_in_its_system_turn(
    smol: PreTrainedTokenizerBase,
) -> None:
    fmt = chat_format(smol, TOOLS)
    assert not fmt.native_tools and fmt.tool_role and fmt.family == "hermes"
    messages = fmt.initial([{"role": "user", "content": "What is 12*34?"}])
    assert messages[0] == {"role": "system", "content": default_tool_prompt(TOOLS)}
    text = smol.decode(fmt.render(messages))
    assert '"name": "multiply"' in text and "<tool_call>" in text
    assert "helpful AI assistant named SmolLM" not in text  # our system turn replaced its default
    # A conversation's own system turn keeps its text after the tool prompt.
    own = fmt.initial(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    )
    assert len(own) == 2 and own[0]["content"].endswith("\n\nBe brief.")


def test_an_episode_starts_from_the_tool_prompt_then_the_few_shot_demonstration(
    smol: PreTrainedTokenizerBase,
) -> None:
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    few_shot = [
        {"role": "user", "content": "What is 2*3?"},
        {"role": "assistant", "content": call},
        {"role": "user", "content": "Tool result (multiply):\n6"},
        {"role": "assistant", "content": "6"},
    ]
    dataset = DatasetSpec.model_validate(
        {"rows": [{"prompt": "What is 12*34?"}], "system_prompt": "Be brief.", "few_shot": few_shot}
    )
    fmt = chat_format(smol, TOOLS)
    messages = fmt.initial(conversation(Example("What is 12*34?", None), dataset))
    assert messages[0]["role"] == "system" and messages[0]["content"].endswith("\n\nBe brief.")
    assert messages[1:] == [*few_shot, {"role": "user", "content": "What is 12*34?"}]


def test_a_template_that_renders_tools_gets_them_through_tools(
    smol: PreTrainedTokenizerBase,
) -> None:
    fmt = chat_format(with_template(smol, QWEN_LIKE), TOOLS)
    assert fmt.native_tools and fmt.family == "hermes"
    messages = fmt.initial([{"role": "user", "content": "hi"}])
    assert messages == [{"role": "user", "content": "hi"}]  # nothing added: the template does it
    assert '"name": "multiply"' in smol.decode(fmt.render(messages))


def test_a_template_without_the_tool_role_gets_results_as_a_prefixed_user_turn(
    smol: PreTrainedTokenizerBase,
) -> None:
    fmt = chat_format(with_template(smol, STRICT_ROLES), TOOLS)
    assert not fmt.tool_role and not fmt.native_tools
    message = fmt.tool_message("multiply", "408")
    assert message == {"role": "user", "content": f"{TOOL_RESULT_PREFIX} (multiply):\n408"}
    assert chat_format(smol, TOOLS).tool_message("multiply", "408")["role"] == "tool"


def test_hermes_calls_are_parsed_and_malformed_ones_reported_not_raised() -> None:
    turn = parse_hermes(
        'Let me compute.\n<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}'
        "</tool_call>\n<tool_call>\n"
        '{"name": "multiply", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    )
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("multiply", {"a": 12, "b": 34}),
        ("multiply", {"a": 1, "b": 2}),
    ]
    assert turn.malformed == []
    bad: dict[str, Any] = {
        "<tool_call>{not json}</tool_call>": "not JSON",
        "<tool_call>[1, 2]</tool_call>": "not a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no tool name",
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>': "arguments",
        'answer <tool_call>{"name": "f", "argu': "not closed",
        "<tool_call>" + "[" * 100_000 + "</tool_call>": "not JSON",
    }
    for text, reason in bad.items():
        parsed = parse_hermes(text)
        assert parsed.calls == [] and len(parsed.malformed) == 1, text
        assert reason in parsed.malformed[0], (text, parsed.malformed)
    assert parse_hermes('answer <tool_call>{"name"').content == "answer"
    assert parse_hermes("plain answer 408").calls == []


def test_the_parser_family_comes_from_the_tokenizer(smol: PreTrainedTokenizerBase) -> None:
    assert parser_family(smol) == "hermes"  # no tool format of its own: the default's
    assert parser_family(with_template(smol, QWEN_LIKE)) == "hermes"


def test_token_delta_takes_the_suffix_only_after_an_exact_prefix() -> None:
    assert token_delta([1, 2, 3], [1, 2, 3, 4, 5]) == ([4, 5], None)
    assert token_delta([1, 2, 3], [1, 2, 3]) == ([], None)
    assert token_delta([1, 2, 3], [1, 9, 3, 4]) == ([], 1)
    assert token_delta([1, 2, 3], [1, 2]) == ([], 2)
