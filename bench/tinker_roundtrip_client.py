"""The client half of ``bench/tinker_roundtrip.py``: the official `tinker` SDK (0.38.0, run by
``.venv-tinker/bin/python``, an environment without torch or any of our code) doing the
driver's batch against a live grpo-service, one iteration whenever the driver asks for one.

    python tinker_roundtrip_client.py BASE_URL CONFIG.json     # TINKER_API_KEY set

CONFIG holds ``base_model``, ``rank``, ``seed``, ``learning_rate``, ``batch`` (token lists)
and ``clients``: the training clients to make, each with the same seed. ``sequential`` waits on
each call before sending the next (``forward_backward(batch, "cross_entropy").result()``, then
``optim_step(...).result()``); ``pipelined`` submits both calls before waiting on either, as a
loop may. Then each stdin line ``sequential`` or ``pipelined`` runs one iteration of that
client, timed here (until forward_backward's result, until optim_step's, the whole round trip);
``quit`` ends. Every answer is one stdout line: ``@@`` and a JSON object (the first: the
clients' creation).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tinker  # type: ignore[import-not-found]
from tinker import types  # type: ignore[import-not-found]


def datum(tokens: list[int]) -> Any:
    """Next-token prediction of ``tokens``, every position weighted 1 (the driver's Datum)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def emit(data: dict[str, Any]) -> None:
    print("@@ " + json.dumps(data), flush=True)


def iteration(client: Any, batch: list[Any], adam: Any, pipelined: bool) -> dict[str, float]:
    start = time.perf_counter()
    if pipelined:
        fb_future = client.forward_backward(batch, "cross_entropy")
        step_future = client.optim_step(adam)
        result = fb_future.result()
        after_fb = time.perf_counter()
        step = step_future.result()
    else:
        result = client.forward_backward(batch, "cross_entropy").result()
        after_fb = time.perf_counter()
        step = client.optim_step(adam).result()
    end = time.perf_counter()
    return {
        "forward_backward_s": after_fb - start,
        "optim_step_s": end - after_fb,
        "round_trip_s": end - start,
        "loss_sum": float(result.metrics["loss:sum"]),
        "grad_norm": float((step.metrics or {}).get("optim/grad_norm:mean", float("nan"))),
    }


def main() -> None:
    base_url, config_path = sys.argv[1], Path(sys.argv[2])
    config = json.loads(config_path.read_text())
    service = tinker.ServiceClient(base_url=base_url)
    batch = [datum(tokens) for tokens in config["batch"]]
    adam = types.AdamParams(learning_rate=config["learning_rate"])
    clients: dict[str, Any] = {}
    created: dict[str, float] = {}
    for mode in config["clients"]:
        start = time.perf_counter()
        clients[mode] = service.create_lora_training_client(
            base_model=config["base_model"], rank=config["rank"], seed=config["seed"]
        ).result()
        created[mode] = time.perf_counter() - start
    model_ids = {mode: client.model_id for mode, client in clients.items()}
    emit({"sdk_version": tinker.__version__, "create_client_s": created, "model_ids": model_ids})
    for line in sys.stdin:
        mode = line.strip()
        if mode == "quit":
            break
        emit(iteration(clients[mode], batch, adam, pipelined=mode == "pipelined"))


if __name__ == "__main__":
    main()
