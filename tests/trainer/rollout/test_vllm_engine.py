from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from jobspec import EpisodeSpec
from tests.trainer.rollout.conftest import chat_prompts, teacher_forced_logprobs
from trainer.agents import EnvStep, Episode, TurnSettings, chat_format, run_episodes, start_episodes
from trainer.distributed.weights import bucketed
from trainer.models.loading import load_policy, resolve_model
from trainer.rollout.base import Completion
from trainer.rollout.hf_engine import HFEngine
from trainer.rollout.registry import make_engine

pytest.importorskip("vllm")  # GPU test machines carry no vLLM build

from trainer.rollout.vllm_engine import VLLMEngine
from trainer.rollout.vllm_weights import ADAPTER_FILE, engine_tensors, write_adapter_folder

QUESTIONS = ["what is 2+3?", "hi", "count: 1, 2, 3"]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[VLLMEngine]:
    # One engine for the module: starting one costs seconds. Each test that depends on the
    # engine's weights syncs them first, so test order does not matter.
    _, tokenizer = load_policy(tiny_model_dir)
    vllm_engine = make_engine(
        "vllm",
        tiny_model_dir,
        tokenizer,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=256 << 20,
    )
    assert isinstance(vllm_engine, VLLMEngine)
    yield vllm_engine
    vllm_engine.close()


@pytest.fixture()
def policy(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_policy(tiny_model_dir)


def _ids(groups: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def _mean_logprob_gap(
    model: PreTrainedModel,
    prompts: list[list[int]],
    groups: list[list[Completion]],
    temperature: float,
) -> float:
    """Mean |engine logprob - transformers logprob| over all sampled tokens."""
    gaps = []
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert c.logprobs is not None
            reference = teacher_forced_logprobs(model, prompt, c.token_ids, temperature)
            gaps.append((torch.tensor(c.logprobs) - reference).abs())
    return torch.cat(gaps).mean().item()


def test_importing_base_does_not_import_vllm(tmp_path: Path) -> None:
    import subprocess

    code = "import sys, trainer.rollout.base; print('vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_generate_shapes_and_finish_reasons(engine: VLLMEngine, policy) -> None:
    model, tokenizer = policy
    engine.sync_weights(model)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    groups = engine.generate(prompts, 4, max_new_tokens=24, temperature=1.0, seed=0)
    assert len(groups) == len(prompts)
    reasons = set()
    for group in groups:
        assert len(group) == 4
        for c in group:
            assert 1 <= len(c.token_ids) <= 24
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            eos_positions = [i for i, t in enumerate(c.token_ids) if t == tokenizer.eos_token_id]
            if c.finish_reason == "stop":
                assert eos_positions == [len(c.token_ids) - 1]
            else:
                assert eos_positions == [] and len(c.token_ids) == 24
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1


def test_per_call_seed_is_deterministic(engine: VLLMEngine, policy) -> None:
    model, tokenizer = policy
    engine.sync_weights(model)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    kwargs = {"max_new_tokens": 16, "temperature": 0.9}
    torch.manual_seed(123)
    expected_next_draw = torch.rand(3)
    torch.manual_seed(123)
    first = engine.generate(prompts, 3, seed=7, **kwargs)
    # The caller's global RNG stream is left where it was.
    assert torch.equal(torch.rand(3), expected_next_draw)
    other = engine.generate(prompts, 3, seed=8, **kwargs)
    greedy = engine.generate(prompts[:1], 2, seed=7, greedy=True, **kwargs)
    again = engine.generate(prompts, 3, seed=7, **kwargs)
    assert again == first
    assert _ids(other) != _ids(first)
    assert len(greedy[0]) == 2


def test_logprobs_match_transformers_at_temperature(engine: VLLMEngine, policy) -> None:
    model, tokenizer = policy
    engine.sync_weights(model)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    for temperature in (0.6, 1.0, 1.4):
        groups = engine.generate(prompts, 3, max_new_tokens=20, temperature=temperature, seed=3)
        assert _mean_logprob_gap(model, prompts, groups, temperature) < 1e-4


def test_greedy_matches_transformers_greedy(engine: VLLMEngine, policy, tiny_model_dir) -> None:
    model, tokenizer = policy
    engine.sync_weights(model)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    kwargs = {"max_new_tokens": 20, "temperature": 0.8, "seed": 0, "greedy": True}
    ours = engine.generate(prompts, 2, **kwargs)
    hf = HFEngine(model, tokenizer, dtype="float32", max_model_len=MAX_MODEL_LEN)
    reference = hf.generate(prompts, 2, **kwargs)
    assert _ids(ours) == _ids(reference)
    assert [[c.finish_reason for c in g] for g in ours] == [
        [c.finish_reason for c in g] for g in reference
    ]
    # Greedy logprobs are reported at temperature 1, like the transformers engine.
    assert _mean_logprob_gap(model, prompts, ours, 1.0) < 1e-4


def test_weight_sync_is_real(engine: VLLMEngine, policy) -> None:
    model, tokenizer = policy
    assert engine.sync_weights(model) > 0.0  # a real reload takes measurable time
    prompts = chat_prompts(tokenizer, QUESTIONS)
    greedy = {"max_new_tokens": 20, "temperature": 1.0, "seed": 0, "greedy": True}
    old_greedy = engine.generate(prompts, 1, **greedy)

    # One large SGD step that makes the policy prefer "7" after every prompt.
    target = tokenizer.convert_tokens_to_ids("7")
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    model.train()
    batch = torch.tensor([p[-4:] for p in prompts])  # [3, 4], same length, no padding
    logits = model(batch).logits[:, -1]  # [3, V]
    loss = torch.nn.functional.cross_entropy(logits, torch.full((3,), target))
    loss.backward()
    optimizer.step()
    model.eval()

    hf = HFEngine(model, tokenizer, dtype="float32", max_model_len=MAX_MODEL_LEN)
    new_greedy = hf.generate(prompts, 1, **greedy)
    assert _ids(new_greedy) != _ids(old_greedy)  # the update changed the policy's behaviour

    sampling = {"max_new_tokens": 20, "temperature": 0.8, "seed": 11}
    # Before the sync the engine still runs the old weights...
    assert _ids(engine.generate(prompts, 1, **greedy)) == _ids(old_greedy)
    stale = engine.generate(prompts, 2, **sampling)
    assert _mean_logprob_gap(model, prompts, stale, 0.8) > 1e-2

    seconds = engine.sync_weights(model)
    assert 0.0 < seconds < 30.0
    # ...and after it, it generates from the new ones, with matching logprobs.
    assert _ids(engine.generate(prompts, 1, **greedy)) == _ids(new_greedy)
    fresh = engine.generate(prompts, 2, **sampling)
    assert _mean_logprob_gap(model, prompts, fresh, 0.8) < 1e-3


def test_streamed_buckets_give_the_engine_the_same_weights_as_a_module_sync(
    engine: VLLMEngine, policy
) -> None:
    """Several ranks stream their gathers into the engine in buckets
    (``load_weight_buckets``); the engine then generates exactly as after a module sync."""
    model, tokenizer = policy
    prompts = chat_prompts(tokenizer, QUESTIONS)
    greedy = {"max_new_tokens": 16, "temperature": 1.0, "seed": 0, "greedy": True}
    sampling = {"max_new_tokens": 16, "temperature": 0.8, "seed": 5}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(model)
    by_module = (engine.generate(prompts, 1, **greedy), engine.generate(prompts, 2, **sampling))
    engine.sync_weights(load_policy(resolve_model("tiny-random-llama"))[0])  # back to the base
    assert _ids(engine.generate(prompts, 1, **greedy)) != _ids(by_module[0])

    buckets = list(bucketed(engine_tensors(model, torch.float32), 4096))
    assert len(buckets) > 3
    assert engine.load_weight_buckets(iter(buckets)) > 0.0
    assert _ids(engine.generate(prompts, 1, **greedy)) == _ids(by_module[0])
    assert _ids(engine.generate(prompts, 2, **sampling)) == _ids(by_module[1])


def test_an_adapter_folder_written_from_streamed_tensors_is_peft_s_own(
    tmp_path: Path, policy
) -> None:
    """The "adapter" view's tensors and the peft config give the files a PeftModel's
    save_pretrained writes: the same tensor names and values, a config peft reads back."""
    from peft import LoraConfig, PeftConfig, get_peft_model
    from safetensors.torch import load_file

    model, _ = policy
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(model, config)
    own = tmp_path / "own"
    peft_model.save_pretrained(str(own))
    adapter = [(k, v) for k, v in peft_model.state_dict().items() if ".lora_" in k]
    written = write_adapter_folder(
        tmp_path / "streamed", adapter, peft_model.peft_config["default"]
    )
    ours, theirs = load_file(str(written / ADAPTER_FILE)), load_file(str(own / ADAPTER_FILE))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert PeftConfig.from_pretrained(str(written)).to_dict() == config.to_dict() | {
        "base_model_name_or_path": peft_model.peft_config["default"].base_model_name_or_path
    }
    with pytest.raises(ValueError, match="not an adapter tensor"):
        write_adapter_folder(
            tmp_path / "bad", [("model.embed_tokens.weight", ours[next(iter(ours))])], config
        )


class AskAgain:
    """An environment that asks again after every answer (the episode ends at max_turns)."""

    def reset(self, ids: Any, items: Any) -> list[EnvStep]:
        return [EnvStep() for _ in ids]

    def step(self, ids: Any, messages: Any) -> list[EnvStep]:
        return [EnvStep([{"role": "user", "content": "again?"}]) for _ in ids]

    def close(self) -> None:
        pass


class ClosedTurns:
    """The engine with every turn closed: a turn the engine cut at ``max_new_tokens - 1`` gets
    the end token appended (log-prob 0.0, finish "stop"), so that every episode of the random
    model takes all its turns. It has no ``keep_prefix_cache``: each call clears the prefix
    cache and prefills the whole conversation again, as every rollout did before issue 32."""

    def __init__(self, engine: VLLMEngine, end: int) -> None:
        self.engine, self.end = engine, end

    def generate(
        self, prompts: list[list[int]], n: int, *, max_new_tokens: int, **kwargs: Any
    ) -> list[list[Completion]]:
        groups = self.engine.generate(prompts, n, max_new_tokens=max_new_tokens - 1, **kwargs)
        return [[self._closed(c) for c in group] for group in groups]

    def _closed(self, c: Completion) -> Completion:
        if c.finish_reason == "stop":
            return c
        assert c.logprobs is not None
        return Completion([*c.token_ids, self.end], [*c.logprobs, 0.0], c.text, "stop")


class ClosedTurnsKeepingTheCache(ClosedTurns):
    """:class:`ClosedTurns` that keeps the engine's prefix cache across a rollout's turns."""

    def keep_prefix_cache(self) -> Any:
        return self.engine.keep_prefix_cache()


def _episodes(
    engine: Any, tokenizer: PreTrainedTokenizerBase, turns: int, questions: list[str] = QUESTIONS
) -> list[Episode]:
    """Greedy episodes of ``turns`` turns, one per question, each prompt over one KV block (128
    tokens) and no two alike from their first token (so they share no cached block)."""
    fmt = chat_format(tokenizer)
    system = " you are a careful assistant. answer in one short line." * 3
    conversations = [[{"role": "system", "content": q + system}, {"role": "user", "content": q}]
                     for q in questions]  # fmt: skip
    environment = AskAgain()
    episodes = start_episodes(fmt, conversations, [{}] * len(questions), environment)
    assert all(len(e.context) > 128 for e in episodes)
    settings = TurnSettings(
        max_new_tokens=8,
        temperature=1.0,
        seed=0,
        budgets=EpisodeSpec(max_turns=turns, max_episode_tokens=MAX_MODEL_LEN),
        stop_token_ids=(int(tokenizer.eos_token_id),),
        greedy=True,
    )
    run_episodes(engine, fmt, episodes, settings, environment=environment)
    assert all(e.turns == turns for e in episodes)
    return episodes


def test_a_multi_turn_rollout_reads_each_turns_conversation_from_the_prefix_cache(
    engine: VLLMEngine, policy
) -> None:
    model, tokenizer = policy
    engine.sync_weights(model)
    end = int(tokenizer.eos_token_id)
    before = dataclasses.replace(engine.prefill)
    kept = _episodes(ClosedTurnsKeepingTheCache(engine, end), tokenizer, turns=3)
    # Turns 2 and 3 of each episode find at least the conversation's first full block cached.
    assert engine.prefill.cached_tokens - before.cached_tokens >= 2 * len(QUESTIONS) * 128
    middle = dataclasses.replace(engine.prefill)
    cleared = _episodes(ClosedTurns(engine, end), tokenizer, turns=3)
    assert engine.prefill.cached_tokens == middle.cached_tokens  # every turn prefilled afresh
    # Reading the cache changes nothing of what is sampled.
    for a, b in zip(kept, cleared, strict=True):
        assert a.segments[0].completion_ids == b.segments[0].completion_ids
        assert a.segments[0].logprobs == pytest.approx(b.segments[0].logprobs, abs=1e-5)
    # A rollout starts from an empty cache: its first turn reads nothing an earlier rollout
    # of the same prompt left there.
    again = dataclasses.replace(engine.prefill)
    _episodes(ClosedTurnsKeepingTheCache(engine, end), tokenizer, turns=1, questions=QUESTIONS[:1])
    assert engine.prefill.cached_tokens == again.cached_tokens


def test_prompt_must_fit_max_model_len(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * MAX_MODEL_LEN], 1, max_new_tokens=4, temperature=1.0, seed=0)


@pytest.mark.slow
def test_smollm2_bfloat16_engine_answers_and_syncs() -> None:
    # A second engine in this module: the real model, in the dtype production runs use.
    path = resolve_model("smollm2-135m-instruct")
    model, tokenizer = load_policy(path)
    smol = make_engine("vllm", path, tokenizer, dtype="bfloat16", max_model_len=512)
    try:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is 2+3? Answer with a number."}],
                add_generation_prompt=True,
            )["input_ids"]
        ]
        kwargs = {"max_new_tokens": 24, "temperature": 1.0, "seed": 0, "greedy": True}
        answer = smol.generate(prompts, 1, **kwargs)[0][0]
        assert "5" in answer.text, answer.text
        assert answer.finish_reason == "stop"
        seconds = smol.sync_weights(model)
        assert seconds < 30.0
        assert smol.generate(prompts, 1, **kwargs)[0][0] == answer
        sampled = smol.generate(prompts, 4, max_new_tokens=24, temperature=1.0, seed=0)
        # bf16 engine vs fp32 trainer: close, not equal.
        assert _mean_logprob_gap(model, prompts, sampled, 1.0) < 0.1
    finally:
        smol.close()
