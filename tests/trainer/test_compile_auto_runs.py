"""The training loop on the tiny random Llama with ``grpo.micro_batch_size: auto`` and with
``grpo.compile``: auto resolves once at start-up to the memory plan's choice for the run's
device (said in an event) and then trains exactly as that number does; a compiled run trains
as the eager one (within 1e-6), its layers compiled (the recording backend of
tests/trainer/update/test_compile.py: inductor's C++ build would take minutes here)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

import trainer.update.compiled as compiled_module
import trainer.update.micro_batch as micro_batch_module
from jobspec import JobSpec
from jobspec.memory_plan import DEFAULT_SAFETY, PlanInputs, plan_memory, resolve_micro_batch
from jobspec.model_shape import read_model_shape
from tests.trainer.test_loop import tiny_spec
from tests.trainer.update.test_compile import RecordingBackend
from trainer.distributed.sharding import decoder_layers
from trainer.models.loading import load_policy, resolve_model
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train
from trainer.update.compiled import is_compiled

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]
TOLERANCE = 1e-6


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Dynamo's compiled variants count per function (the decoder layer's forward) for the
    whole process, against its recompile limit: each test starts with none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Seen(Callbacks):
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.events: list[tuple[str, str, dict[str, Any] | None]] = []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = metrics

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, Any] | None = None
    ) -> None:
        self.events.append((kind, message, data))


def _run(spec: JobSpec, out: Path, model: torch.nn.Module | None = None) -> Seen:
    seen = Seen()
    if model is None:
        train(spec, seen, output_dir=out)
    else:
        _, tokenizer = load_policy(resolve_model(spec.model))
        train(spec, seen, output_dir=out, model=model, tokenizer=tokenizer)
    assert seen.steps and all("loss/policy" in m for m in seen.steps.values())
    return seen


def _figures(seen: Seen) -> dict[int, dict[str, float]]:
    """The steps' metrics without the timings (and what is derived from them)."""
    noisy = ("time/", "tokens_per_s/", "rank/")
    return {
        step: {k: v for k, v in metrics.items() if not k.startswith(noisy)}
        for step, metrics in seen.steps.items()
    }


def _assert_same(a: Seen, b: Seen) -> None:
    fa, fb = _figures(a), _figures(b)
    assert fa.keys() == fb.keys()
    for step in fa:
        assert fa[step].keys() == fb[step].keys()
        for key, value in fa[step].items():
            assert value == pytest.approx(fb[step][key], rel=TOLERANCE, abs=TOLERANCE), key


def test_auto_resolves_at_start_up_and_trains_as_that_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auto = tiny_spec(steps=2, grpo={"micro_batch_size": "auto"})
    eight = tiny_spec(steps=2, grpo={"micro_batch_size": 8})
    shape = read_model_shape(resolve_model("tiny-random-llama"))
    # A host whose memory holds the plan at micro-batches of 8, not 16.
    needs = plan_memory(shape, PlanInputs.from_spec(eight), device_memory=1 << 40).total
    memory = math.ceil(needs / DEFAULT_SAFETY)
    assert resolve_micro_batch(auto, shape, device_memory=memory, accelerator="cpu") == 8
    monkeypatch.setattr(micro_batch_module, "host_memory", lambda: memory)

    resolved = _run(auto, tmp_path / "auto")
    said = [data for kind, message, data in resolved.events if "micro_batch_size auto" in message]
    assert said == [{"micro_batch_size": 8, "device_memory": memory}]
    _assert_same(resolved, _run(eight, tmp_path / "eight"))


def test_auto_on_a_large_host_takes_the_whole_update_in_one_pass(tmp_path: Path) -> None:
    seen = _run(tiny_spec(steps=1, grpo={"micro_batch_size": "auto"}), tmp_path)
    said = [data for _kind, message, data in seen.events if "micro_batch_size auto" in message]
    assert said and said[0] is not None
    assert said[0]["micro_batch_size"] == 64  # 8 prompts x 8 completions, a power of two


def test_a_compiled_run_trains_as_the_eager_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grpo = {
        "num_iterations": 2,  # a scoring pass (pi_old) through the compiled layers too
        "micro_batch_size": 16,
        "kl": {"estimator": "k3", "beta": 0.04, "placement": "loss"},
    }
    eager = _run(tiny_spec(steps=2, grpo=grpo), tmp_path / "eager")
    recorder = RecordingBackend()
    monkeypatch.setattr(compiled_module, "COMPILE_BACKEND", recorder)
    model, _ = load_policy(resolve_model("tiny-random-llama"))
    compiled = _run(tiny_spec(steps=2, grpo={**grpo, "compile": True}), tmp_path / "c", model)
    layers = decoder_layers(model)
    assert layers and all(is_compiled(layer) for layer in layers)
    assert recorder.forward and recorder.backward
    assert any("torch.compile" in message for _kind, message, _data in compiled.events)
    _assert_same(compiled, eager)
