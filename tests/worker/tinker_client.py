"""Loops a user writes with the official `tinker` SDK (0.38, unchanged), run by
``.venv-tinker/bin/python`` (an environment without torch) against a live grpo-service:
``python tinker_client.py BASE_URL SCENARIO``, with TINKER_API_KEY set; prints one JSON object.

Scenarios:
- ``sl``: supervised (cross_entropy) steps on a few fixed sequences: the loss per step; then
  save_state, one more step, and a second client restored from the state
  (create_training_client_from_state_with_optimizer) doing the same step: both losses.
- ``rl``: sample groups from the training client's saved weights, reward completions that hold
  the token the reward likes, importance_sampling + optim_step: the mean reward per step.
- ``errors``: the SDK error class and status of each bad call.
- ``idle GO_FILE``: supervised steps, then quiet (heartbeating) with gradients pending until
  GO_FILE exists, then more steps: the losses (tests/worker/test_tinker_sharing.py).
- ``serve PROMPT TARGET`` (token ids as JSON lists): cross_entropy steps teach the client to
  answer PROMPT with TARGET, then save_weights_for_sampler("served"): the model id, the path,
  the sampler's greedy completion of PROMPT, and that of a sampling client over the base model
  alone (for tests/inference/test_tinker_served.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import tinker  # type: ignore[import-not-found]
from tinker import types  # type: ignore[import-not-found]

BASE_MODEL = "tiny-random-llama"


def datum(tokens: list[int]) -> Any:
    """Next-token prediction of ``tokens`` (each position predicts the following token)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def mean_nll(result: Any, batch: list[Any]) -> float:
    total, count = 0.0, 0.0
    for output, item in zip(result.loss_fn_outputs, batch, strict=True):
        logprobs = output["logprobs"].tolist()
        weights = item.loss_fn_inputs["weights"].tolist()
        total -= sum(lp * w for lp, w in zip(logprobs, weights, strict=True))
        count += sum(weights)
    return total / count


def supervised(service: Any) -> dict[str, Any]:
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    batch = [datum([1, 5, 6, 7, 8, 9, 10]), datum([1, 11, 12, 13]), datum([1, 5, 6, 14, 15])]
    adam = types.AdamParams(learning_rate=5e-3)
    losses = []
    for _ in range(6):
        result = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(adam).result()
        losses.append(mean_nll(result, batch))
    state = client.save_state("mid").result().path
    straight = client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(adam).result()
    after_straight = mean_nll(client.forward(batch, "cross_entropy").result(), batch)
    restored = service.create_training_client_from_state_with_optimizer(state).result()
    again = restored.forward_backward(batch, "cross_entropy").result()
    restored.optim_step(adam).result()
    after_restored = mean_nll(restored.forward(batch, "cross_entropy").result(), batch)
    runs = service.create_rest_client().list_checkpoints(client.model_id).result()
    return {
        "losses": losses,
        "loss_sum": straight.metrics["loss:sum"],
        "state_path": state,
        "straight": [mean_nll(straight, batch), after_straight],
        "restored": [mean_nll(again, batch), after_restored],
        "checkpoints": [c.checkpoint_id for c in runs.checkpoints],
    }


def reinforce(service: Any) -> dict[str, Any]:
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    liked = 9  # the reward: the share of sampled tokens that are this token
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    rewards = []
    for _ in range(5):
        sampler = client.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
        scores = [seq.tokens.count(liked) / len(seq.tokens) for seq in sampled.sequences]
        mean = sum(scores) / len(scores)
        rewards.append(mean)
        batch = []
        for seq, score in zip(sampled.sequences, scores, strict=True):
            tokens = [*prompt.to_ints(), *seq.tokens]
            n_prompt = prompt.length
            batch.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (n_prompt - 1) + [score - mean] * len(seq.tokens),
                    },
                )
            )
        client.forward_backward(batch, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return {"rewards": rewards}


def errors(service: Any) -> dict[str, Any]:
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    out: dict[str, Any] = {}
    try:
        client.forward_backward([datum([1, 2, 3])], "no_such_loss").result()
    except Exception as exc:  # the SDK's class names the failure
        out["unknown_loss"] = [type(exc).__name__, getattr(exc, "status_code", None), str(exc)]
    try:
        service.create_lora_training_client(base_model="nobody/nothing", rank=4).result()
    except Exception as exc:
        out["unknown_model"] = [type(exc).__name__, getattr(exc, "status_code", None), str(exc)]
    return out


def served(service: Any, prompt: list[int], target: list[int]) -> dict[str, Any]:
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    tokens = [*prompt, *target]
    item = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(target),
        },
    )
    for _ in range(8):
        client.forward_backward([item], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    path = client.save_weights_for_sampler("served").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    greedy = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=len(target), temperature=0.0),
    ).result()
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    untrained = base.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=len(target), temperature=0.0),
    ).result()
    return {
        "model_id": client.model_id,
        "path": path,
        "greedy": greedy.sequences[0].tokens,
        "base_greedy": untrained.sequences[0].tokens,
    }


def idle(service: Any, go_file: str) -> dict[str, Any]:
    """Two supervised steps, a ``forward_backward`` whose gradients are not applied yet, then
    quiet (the SDK heartbeats by itself) until ``go_file`` exists; then the step and two more.
    Prints ``{"ready": ...}`` when it goes quiet, and the losses at the end."""
    client = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    batch = [datum([1, 5, 6, 7, 8, 9, 10]), datum([1, 11, 12, 13]), datum([1, 5, 6, 14, 15])]
    adam = types.AdamParams(learning_rate=5e-3)
    losses = []
    for _ in range(2):
        losses.append(mean_nll(client.forward_backward(batch, "cross_entropy").result(), batch))
        client.optim_step(adam).result()
    losses.append(mean_nll(client.forward_backward(batch, "cross_entropy").result(), batch))
    print(json.dumps({"ready": client.model_id}), flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.2)
    client.optim_step(adam).result()
    for _ in range(2):
        losses.append(mean_nll(client.forward_backward(batch, "cross_entropy").result(), batch))
        client.optim_step(adam).result()
    return {"model_id": client.model_id, "losses": losses}


def main() -> None:
    base_url, scenario = sys.argv[1], sys.argv[2]
    service = tinker.ServiceClient(base_url=base_url)
    if scenario == "idle":
        print(json.dumps(idle(service, sys.argv[3])))
        return
    if scenario == "serve":
        print(json.dumps(served(service, json.loads(sys.argv[3]), json.loads(sys.argv[4]))))
        return
    run = {"sl": supervised, "rl": reinforce, "errors": errors}[scenario]
    print(json.dumps(run(service)))


if __name__ == "__main__":
    main()
