from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from jobspec import DatasetSpec, PromptRow
from trainer.data.dataset import (
    Example,
    PromptSampler,
    PromptsTooLong,
    SamplerState,
    conversation,
    dataset_rows,
    encode_prompt,
    encode_prompts,
    fit_prompts,
    format_prompt,
    prompts_for_run,
    split_holdout,
    with_rows,
)
from trainer.errors import TrainerError
from trainer.models.loading import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tiny_tokenizer()


def test_inline_rows() -> None:
    spec = DatasetSpec(rows=[PromptRow(prompt="a", answer="1"), PromptRow(prompt="b")])
    rows = dataset_rows(spec)
    assert [(r.prompt, r.answer) for r in rows] == [("a", "1"), ("b", None)]
    # What graders see: the row as it was given.
    assert [r.grading_item for r in rows] == [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]


def test_generator_is_seeded_and_correct() -> None:
    gen = {"type": "arithmetic", "count": 50, "min_operand": 2, "max_operand": 5, "seed": 3}
    rows = dataset_rows(DatasetSpec.model_validate({"generator": gen}))
    again = dataset_rows(DatasetSpec.model_validate({"generator": gen}))
    other = dataset_rows(DatasetSpec.model_validate({"generator": {**gen, "seed": 4}}))
    assert rows == again and rows != other and len(rows) == 50
    for row in rows:
        a, b = row.prompt.removeprefix("What is ").split("?")[0].split("+")
        assert 2 <= int(a) <= 5 and 2 <= int(b) <= 5
        assert row.answer == str(int(a) + int(b))


def test_generator_multiplies_two_and_three_digit_numbers() -> None:
    gen = {"type": "arithmetic", "operation": "multiply", "count": 40, "seed": 5}
    gen |= {"min_operand": 10, "max_operand": 999}
    rows = dataset_rows(DatasetSpec.model_validate({"generator": gen}))
    for row in rows:
        a, b = str(row.prompt).removeprefix("What is ").split("?")[0].split("*")
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999
        assert row.answer == str(int(a) * int(b))
    # A template of the job's own is kept; the answer still follows the operation.
    own = {**gen, "count": 1, "template": "Compute {a} times {b}."}
    (row,) = dataset_rows(DatasetSpec.model_validate({"generator": own}))
    x, y = str(row.prompt).removeprefix("Compute ").rstrip(".").split(" times ")
    assert row.answer == str(int(x) * int(y))
    # Addition stays the default, with its own template.
    added = dataset_rows(DatasetSpec.model_validate({"generator": {"type": "arithmetic"}}))
    assert all("+" in str(row.prompt) for row in added)


def test_generator_template_keeps_other_braces() -> None:
    gen = {"type": "arithmetic", "count": 1, "template": "{x} {a} plus {b} = {}"}
    (row,) = dataset_rows(DatasetSpec.model_validate({"generator": gen}))
    assert row.prompt.startswith("{x} ") and row.prompt.endswith(" = {}")


def test_file_id_must_be_resolved_first() -> None:
    spec = DatasetSpec(file_id="file_abc", holdout=1)
    with pytest.raises(ValueError, match="resolved into rows"):
        dataset_rows(spec)
    resolved = with_rows(spec, [PromptRow(prompt="p1", answer="1"), PromptRow(prompt="p2")])
    assert resolved.file_id is None and resolved.holdout == 1
    assert [(r.prompt, r.answer) for r in dataset_rows(resolved)] == [("p1", "1"), ("p2", None)]


def test_split_holdout_takes_the_end() -> None:
    rows = [Example(str(i), None) for i in range(5)]
    train, held = split_holdout(rows, 2)
    assert [r.prompt for r in train] == ["0", "1", "2"]
    assert [r.prompt for r in held] == ["3", "4"]
    assert split_holdout(rows, 0) == (rows, [])
    with pytest.raises(ValueError):
        split_holdout(rows, 5)


def test_format_prompt_chat_and_raw(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chat = format_prompt(tokenizer, "hi", system_prompt="be brief", use_chat_template=True)
    assert chat == "<s><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert format_prompt(tokenizer, "hi", system_prompt=None, use_chat_template=True) == (
        "<s><|user|>hi<|end|><|assistant|>"
    )
    raw = format_prompt(tokenizer, "hi", system_prompt="be brief", use_chat_template=False)
    assert raw == "be brief\n\nhi"


def test_encode_prompts_chat_has_one_bos_and_never_cuts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = DatasetSpec(rows=[PromptRow(prompt="x")], system_prompt="abc")
    rows = [Example("hello", None)]
    (ids,) = encode_prompts(tokenizer, rows, spec, max_prompt_tokens=1000)
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == "<s><|system|>abc<|end|><|user|>hello<|end|><|assistant|>"
    assert encode_prompts(tokenizer, rows, spec, max_prompt_tokens=len(ids)) == [ids]
    # One token over: refused with the row number, never cut (which dropped the system prompt).
    with pytest.raises(ValueError, match=rf"row 2: the prompt is {len(ids)} tokens"):
        encode_prompts(
            tokenizer, [Example("hi", None), *rows], spec, max_prompt_tokens=len(ids) - 1
        )
    raw_spec = DatasetSpec(rows=[PromptRow(prompt="x")], use_chat_template=False)
    (raw,) = encode_prompts(tokenizer, rows, raw_spec, max_prompt_tokens=1000)
    assert tokenizer.decode(raw, skip_special_tokens=True) == "hello"


def _rows(*prompts: str) -> list[Example]:
    return [Example(p, str(i)) for i, p in enumerate(prompts)]


def test_fit_prompts_skips_long_rows_and_stops_at_the_limit(tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = DatasetSpec(rows=[PromptRow(prompt="x")], use_chat_template=False)
    fitted = fit_prompts(tokenizer, _rows("ab", "abcdef", "a", "abcde", "b"), spec, 4)
    assert fitted.kept == [0, 2, 4] and fitted.too_long == [(1, 6), (3, 5)]
    assert [tokenizer.decode(i) for i in fitted.ids] == ["ab", "a", "b"]
    limited = fit_prompts(tokenizer, _rows("ab", "abcdef", "a", "abcde", "b"), spec, 4, limit=2)
    assert limited.kept == [0, 2] and limited.too_long == [(1, 6)]  # row 3 never looked at


def test_prompts_for_run_reports_skipped_rows_by_dataset_row_number(tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = DatasetSpec(rows=[PromptRow(prompt="x")], system_prompt="system")
    limit = len(encode_prompts(tokenizer, [Example("abc", None)], spec, 1000)[0])
    train = _rows("abc", "too long", "xyz", "also too long")
    held = _rows("held out, too long", "ok")
    prompts = prompts_for_run(tokenizer, train, held, spec, limit, eval_max_rows=5)
    assert [r.prompt for r in prompts.train_rows] == ["abc", "xyz"]
    assert [r.answer for r in prompts.train_rows] == ["0", "2"]  # answers travel with rows
    assert [r.prompt for r in prompts.eval_rows] == ["ok"] and len(prompts.eval_ids) == 1
    assert [number for number, _ in prompts.skipped] == [2, 4, 5]  # 1-based, holdout after
    message, data = prompts.skipped_event()
    longest = max(length for _, length in prompts.skipped)
    assert message == (
        f"skipped 3 dataset rows whose prompt is longer than max_prompt_tokens ({limit}; "
        f"the longest has {longest} tokens): rows 2, 4, 5"
    )
    assert data == {"count": 3, "rows": [2, 4, 5], "max_prompt_tokens": limit, "longest": longest}
    # Nothing to skip: nothing reported.
    assert prompts_for_run(tokenizer, train[:1], [], spec, limit, eval_max_rows=5).skipped == []


def test_a_long_list_of_skipped_rows_is_shortened_in_the_message(tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = DatasetSpec(rows=[PromptRow(prompt="x")], use_chat_template=False)
    rows = _rows("a", *["too long"] * 12)
    prompts = prompts_for_run(tokenizer, rows, [], spec, 2, eval_max_rows=0)
    message, data = prompts.skipped_event()
    assert message.endswith("rows 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 and 2 more")
    assert data["count"] == 12 and data["rows"] == list(range(2, 14))


def test_no_training_row_that_fits_fails_naming_the_limit_and_the_longest(tokenizer) -> None:  # type: ignore[no-untyped-def]
    spec = DatasetSpec(rows=[PromptRow(prompt="x")], use_chat_template=False)
    with pytest.raises(
        PromptsTooLong, match=r"max_prompt_tokens \(3 tokens; the longest has 9\)"
    ) as info:
        prompts_for_run(tokenizer, _rows("abcd", "abcdefghi"), _rows("a"), spec, 3, eval_max_rows=1)
    assert isinstance(info.value, TrainerError) and info.value.reason == "prompts_too_long"


def test_sampler_covers_each_epoch_once_and_reshuffles() -> None:
    sampler = PromptSampler(10, seed=1)
    first, second = sampler.next(10), sampler.next(10)
    assert sorted(first) == list(range(10)) == sorted(second)
    assert first != second  # a new order every epoch
    assert sampler.state().epoch == 1 and sampler.state().index == 10
    assert PromptSampler(10, seed=1).next(20) == first + second
    assert PromptSampler(4, seed=1, shuffle=False).next(6) == [0, 1, 2, 3, 0, 1]


def test_sampler_state_round_trip_is_exact() -> None:
    reference = PromptSampler(7, seed=5)
    draws = [reference.next(3) for _ in range(6)]

    sampler = PromptSampler(7, seed=5)
    sampler.next(3)
    sampler.next(3)
    sampler.next(3)  # crosses into epoch 1
    saved = json.loads(json.dumps(sampler.state().to_dict()))  # as a checkpoint stores it
    resumed = PromptSampler(7, seed=5)
    resumed.restore(SamplerState.from_dict(saved))
    assert [resumed.next(3) for _ in range(3)] == draws[3:]


def test_sampler_refuses_a_state_for_other_data() -> None:
    state = PromptSampler(7, seed=5).state()
    with pytest.raises(ValueError, match="dataset or seed changed"):
        PromptSampler(8, seed=5).restore(state)
    with pytest.raises(ValueError, match="dataset or seed changed"):
        PromptSampler(7, seed=6).restore(state)


def test_a_conversation_row_is_formatted_with_its_own_system_turn() -> None:
    from trainer.models.loading import load_policy, resolve_model

    _, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    own = [{"role": "system", "content": "row sys"}, {"role": "user", "content": "hi"}]
    plain = [{"role": "user", "content": "hi"}]
    with_own = format_prompt(tokenizer, own, system_prompt="dataset sys", use_chat_template=True)
    assert "row sys" in with_own and "dataset sys" not in with_own  # the row's turn wins
    added = format_prompt(tokenizer, plain, system_prompt="dataset sys", use_chat_template=True)
    assert added == format_prompt(
        tokenizer, "hi", system_prompt="dataset sys", use_chat_template=True
    )  # a one-turn conversation formats exactly like the same prompt
    assert format_prompt(tokenizer, own, system_prompt=None, use_chat_template=False) == (
        "row sys\n\nhi"
    )


def test_few_shot_turns_come_after_the_system_turn_and_before_the_row() -> None:
    few_shot = [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "6"}]
    own = [{"role": "system", "content": "row sys"}, {"role": "user", "content": "hi"}]
    assert conversation("hi", system_prompt="sys", few_shot=few_shot) == [
        {"role": "system", "content": "sys"},
        *few_shot,
        {"role": "user", "content": "hi"},
    ]
    assert conversation(own, system_prompt="sys", few_shot=few_shot) == [own[0], *few_shot, own[1]]
    assert conversation("hi", system_prompt=None, few_shot=few_shot) == [
        *few_shot,
        {"role": "user", "content": "hi"},
    ]
    spec = DatasetSpec.model_validate(
        {"rows": [{"prompt": "hi"}], "system_prompt": "sys", "few_shot": few_shot}
    )
    (example,) = dataset_rows(spec)
    tokenizer = build_tiny_tokenizer()
    text = tokenizer.decode(encode_prompt(tokenizer, example, spec))
    assert text.index("sys") < text.index("2*3?") < text.index("6") < text.index("hi")
    for bad, why in (
        ([{"role": "user", "content": "2*3?"}], "end with an assistant turn"),
        ([{"role": "system", "content": "x"}, *few_shot], "user and assistant turns"),
    ):
        with pytest.raises(ValidationError, match=why):
            DatasetSpec.model_validate({"rows": [{"prompt": "hi"}], "few_shot": bad})


def test_rows_validate_their_shape_and_their_extra_fields() -> None:
    ok = PromptRow.model_validate({"prompt": "p", "answer": "1", "tests": [1, {"a": None}]})
    assert ok.item == {"prompt": "p", "answer": "1", "tests": [1, {"a": None}]}
    bad = [
        ({"answer": "1"}, "exactly one of prompt or messages"),
        ({"prompt": "p", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
         "end with a user turn"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"},
                       {"role": "user", "content": "x"}]}, "only come first"),
        ({"prompt": "p", "x": float("inf")}, "finite"),
        ({"prompt": "p", "x": "a\x00b"}, "NUL"),
        ({"prompt": "p", "x": [[[[[[[[[[1]]]]]]]]]]}, "nested deeper"),
        ({"prompt": "p", **{f"f{i}": i for i in range(65)}}, "at most 64 fields"),
    ]  # fmt: skip
    for data, message in bad:
        with pytest.raises(ValidationError, match=message):
            PromptRow.model_validate(data)
