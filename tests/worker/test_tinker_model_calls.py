"""The calls a held Tinker model applies (worker.tinker_requests), checked against
trainer.primitives.ResidentModel driven directly: the results decode to what the session
computes, a bad call fails as the user's error and the next call goes on, and a model created
from a save continues exactly as the saved one did. Rows and bodies as in test_tinker_model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.db import session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerCheckpoint
from tests.worker.test_tinker_model import (
    TINY,
    Client,
    Holder,
    fwdbwd,
    fwdbwd_output,
    new_client,
    sample_output,
    worker_context,
)
from worker.context import WorkerContext
from worker.tinker_model import model_folder

pytestmark = pytest.mark.model


@pytest.fixture
def backend() -> str:
    return "postgres"


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> Iterator[WorkerContext]:
    yield from worker_context(settings, tmp_path)


@pytest.fixture
def client(ctx: WorkerContext) -> Client:
    return new_client(ctx)


# One datum: a prompt token and four trained ones.
DATA = [([2, 10, 11, 12, 13], {"target_tokens": [10, 11, 12, 13, 3], "weights": [0.0, 1, 1, 1, 1]})]
ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
PROMPT = [2, 10, 11]


def optim(model_id: str) -> dict[str, Any]:
    return {"model_id": model_id, "adam_params": ADAM, "type": "optim_step"}


def sample(sampler_id: str, seed: int) -> dict[str, Any]:
    return {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4, "seed": seed, "temperature": 1.0},
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "prompt_logprobs": True,
        "type": "sample",
    }


def result(client: Client, request_id: str) -> bytes:
    (row,) = client.settled(request_id)
    assert row.status == "done", row.error
    assert row.result is not None
    return row.result


def loss(client: Client, request_id: str) -> float:
    return fwdbwd_output(result(client, request_id))[1]["loss:sum"]


def user_error(client: Client, request_id: str) -> str:
    (row,) = client.settled(request_id)
    assert (row.status, row.error_category) == ("failed", "user"), row.error
    assert row.error is not None
    return row.error


def test_calls_compute_what_the_training_session_computes(
    ctx: WorkerContext, client: Client
) -> None:
    from trainer.primitives import Datum, ResidentModel

    a = client.model()
    sampler = client.sampler(0, a)  # the API adds it before queueing the save for it
    calls = {
        "create": client.call(a, "create_model", {"type": "create_model"}),
        "fb": client.call(a, "forward_backward", fwdbwd(a, DATA)),
        "bad_loss": client.call(a, "forward_backward", fwdbwd(a, DATA, "no_such_loss")),
        "step": client.call(a, "optim_step", optim(a)),
        "forward": client.call(a, "forward", fwdbwd(a, DATA, forward_only=True)),
        "save": client.call(a, "save_weights", {"model_id": a, "path": "ck1", "ttl_seconds": 3600}),
        "again": client.call(a, "save_weights", {"model_id": a, "path": "ck1"}),
        "muon": client.call(
            a, "optim_step", {"model_id": a, "optimizer_params": {"type": "dimuon"}}
        ),
        "for_sampler": client.call(
            a, "save_weights_for_sampler", {"model_id": a, "sampling_session_seq_id": 0}
        ),
        "sample": client.call(a, "sample", sample(sampler, seed=7)),
        "image": client.call(
            a,
            "sample",
            {**sample(sampler, 7), "prompt": {"chunks": [{"type": "image", "data": "AA=="}]}},
        ),
    }
    # The same calls on a session of our own, first: a seeded LoRA initialisation draws from
    # torch's global generator, so two sessions must not be built at the same time.
    direct = ResidentModel(model_folder(TINY, ctx.settings), lora_rank=4, seed=0, base_model=TINY)
    data = [Datum(tokens=t, inputs=i) for t, i in DATA]
    expected_fb = direct.forward_backward(data, "cross_entropy")
    direct.optim_step(**ADAM)
    expected_forward = direct.forward_backward(data, "cross_entropy", forward_only=True)
    expected_sample = direct.sample(
        PROMPT, 2, max_tokens=4, seed=7, prompt_logprobs=True, weights=direct.snapshot()
    )
    del direct
    holder = Holder(ctx, a)

    assert json.loads(result(client, calls["create"])) == {"model_id": a, "type": "create_model"}
    logprobs, metrics = fwdbwd_output(result(client, calls["fb"]))
    assert logprobs == [pytest.approx(expected_fb.logprobs[0], abs=1e-6)]
    assert metrics == pytest.approx(expected_fb.metrics)
    assert "no_such_loss" in user_error(client, calls["bad_loss"])
    step = json.loads(result(client, calls["step"]))["metrics"]
    assert step["optim/step:max"] == 1.0  # the failed call changed nothing: one clean step
    after = loss(client, calls["forward"])
    assert after == pytest.approx(expected_forward.metrics["loss:sum"])
    assert after < metrics["loss:sum"]

    path = f"tinker://{a}/weights/ck1"
    assert json.loads(result(client, calls["save"])) == {"path": path, "type": "save_weights"}
    assert "exists" in user_error(client, calls["again"])
    assert "dimuon" in user_error(client, calls["muon"])
    with session_scope(ctx.sessions) as db:
        saved = db.get(TinkerCheckpoint, (a, "weights", "ck1"))
        assert saved is not None and saved.size_bytes > 0 and saved.expires_at is not None
        assert saved.folder.startswith(str(ctx.settings.resolved_checkpoint_dir / "tinker"))
    assert client.model_row(a).last_saved_path == path

    assert json.loads(result(client, calls["for_sampler"])) == {
        "sampling_session_id": sampler,
        "type": "save_weights_for_sampler",
    }
    sequences, prompt_logprobs = sample_output(result(client, calls["sample"]))
    assert [s[0] for s in sequences] == [s.tokens for s in expected_sample.sequences]
    assert expected_sample.prompt_logprobs is not None
    assert prompt_logprobs[1:] == pytest.approx(expected_sample.prompt_logprobs[1:], abs=1e-6)
    assert "image chunks are not supported" in user_error(client, calls["image"])

    client.finish_session()
    assert holder.result() == "closed"


def test_a_model_created_from_a_save_continues_identically(
    ctx: WorkerContext, client: Client
) -> None:
    a = client.model()
    path, named = f"tinker://{a}/weights/ck1", f"tinker://{a}/sampler_weights/s1"
    from_a = client.sampler(0, a, model_path=named)
    first = [
        client.call(a, "create_model", {"type": "create_model"}),
        client.call(a, "forward_backward", fwdbwd(a, DATA)),
        client.call(a, "optim_step", optim(a)),
        client.call(a, "save_weights", {"model_id": a, "path": "ck1"}),
        client.call(a, "save_weights_for_sampler", {"model_id": a, "path": "s1"}),
        client.call(a, "sample", sample(from_a, seed=3)),
        client.call(a, "forward_backward", fwdbwd(a, DATA)),
        client.call(a, "optim_step", optim(a)),
        client.call(a, "forward", fwdbwd(a, DATA, forward_only=True)),
    ]
    holder_a = Holder(ctx, a)
    assert json.loads(result(client, first[4])) == {
        "path": named,
        "type": "save_weights_for_sampler",
    }
    with session_scope(ctx.sessions) as db:
        saved = db.get(TinkerCheckpoint, (a, "weights", "ck1"))
        assert saved is not None
        folder = saved.folder

    # As the API creates a model from a save: its settings, the save's folder, seq 0 the load.
    b = client.model(1, restore_from=folder, restore_optimizer=True)
    from_b = client.sampler(1, b, model_path=named)  # A's sampler weights, read from disk
    load = {"session_id": client.session_id, "model_seq_id": 1, "path": path, "optimizer": True}
    in_place = {"model_id": b, "seq_id": 5, "path": path, "optimizer": True}
    second = [
        client.call(b, "load_weights", {**load, "type": "load_weights"}),
        client.call(b, "sample", sample(from_b, seed=3)),
        client.call(b, "forward_backward", fwdbwd(b, DATA)),
        client.call(b, "optim_step", optim(b)),
        client.call(b, "forward", fwdbwd(b, DATA, forward_only=True)),
        # The deprecated in-place load, back to the same save: the same step again.
        client.call(b, "load_weights", {**in_place, "type": "load_weights"}),
        client.call(b, "forward_backward", fwdbwd(b, DATA)),
        client.call(b, "optim_step", optim(b)),
        client.call(b, "forward", fwdbwd(b, DATA, forward_only=True)),
    ]
    # No task of its own: the worker holding the session's first model takes it (a solo-pool
    # worker busy with A could otherwise never load B, and the client would wait forever).

    assert json.loads(result(client, second[0])) == {
        "model_id": b,
        "path": path,
        "type": "load_weights",
    }
    (from_disk, prompt_b), (in_memory, prompt_a) = (
        sample_output(result(client, second[1])),
        sample_output(result(client, first[5])),
    )
    assert from_disk == in_memory
    assert prompt_b[1:] == prompt_a[1:]  # [0] is NaN: nothing predicts the first token
    continued = loss(client, first[8])
    assert loss(client, second[4]) == pytest.approx(continued, rel=1e-6)
    assert loss(client, second[8]) == pytest.approx(continued, rel=1e-6)
    assert json.loads(result(client, second[7]))["metrics"]["optim/step:max"] == 2.0
    assert client.model_row(b).last_saved_path == path

    assert client.model_row(b).lease_owner == ctx.settings.worker_name
    client.finish_session()
    assert holder_a.result() == "closed"
    assert client.model_row(b).status == "closed"
