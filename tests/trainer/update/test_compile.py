"""``grpo.compile`` (trainer.update.compiled): an update step on the tiny model with its decoder
layers compiled gives the eager step's loss and gradients (within 1e-6), full and LoRA, with
and without gradient checkpointing, and what was compiled is what the test sees built.

The compiler here is AOTAutograd with eager kernels (a recording ``aot_autograd`` backend): it
traces each layer's forward and backward graph as inductor does, without inductor's C++ build,
which takes over a minute for the tiny model on this CPU. The trainer's default, inductor, is
asserted separately.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch import Tensor, nn
from torch._dynamo.backends.common import aot_autograd
from torch.fx import GraphModule

import trainer.run.setup as run_setup
import trainer.update.compiled as compiled_module
from jobspec import GRPOSpec, JobSpec, LoraSpec
from tests.trainer.conftest import tiny_llama
from trainer.distributed.sharding import decoder_layers
from trainer.models.loading import enable_gradient_checkpointing
from trainer.models.lora import apply_lora
from trainer.run.loop import train
from trainer.update.batch import Batch, pack_batch
from trainer.update.compiled import (
    COMPILE_BACKEND,
    CompileNotSupported,
    compile_decoder_layers,
    compile_refusal,
    is_compiled,
)
from trainer.update.optim import build_optimizer
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

VOCAB = 40
TOLERANCE = 1e-6  # float32, absolute and relative: loss and every gradient element


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Dynamo's compiled variants count per function (the decoder layer's forward) for the
    whole process, against its recompile limit: each test starts with none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RecordingBackend:
    """A torch.compile backend that records the forward and backward graphs AOTAutograd
    builds and runs them as they are (eager kernels)."""

    def __init__(self) -> None:
        self.forward: list[GraphModule] = []
        self.backward: list[GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._forward, bw_compiler=self._backward)

    def _forward(self, graph: GraphModule, _inputs: list[Tensor]) -> Any:
        self.forward.append(graph)
        return make_boxed_func(graph.forward)

    def _backward(self, graph: GraphModule, _inputs: list[Tensor]) -> Any:
        self.backward.append(graph)
        return make_boxed_func(graph.forward)

    def __call__(self, graph: GraphModule, inputs: list[Tensor]) -> Any:
        return self.backend(graph, inputs)


def _targets(graphs: list[GraphModule]) -> set[str]:
    return {str(node.target) for graph in graphs for node in graph.graph.nodes}


def _batch(rows: int = 6) -> Batch:
    g = torch.Generator().manual_seed(1)
    return pack_batch(
        [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in (3, 5, 4, 3, 2, 5)],
        [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in (6, 2, 5, 4, 6, 3)],
        [None] * rows,
        [False] * rows,
        torch.ones(rows),
        torch.device("cpu"),
    )


def _model(lora: bool, checkpointing: bool) -> nn.Module:
    model: nn.Module = tiny_llama(VOCAB)
    if checkpointing:
        assert enable_gradient_checkpointing(model)
    if lora:
        model = apply_lora(model, LoraSpec(rank=4, alpha=8))
        with torch.no_grad():  # B random, as after some training, so the adapters matter
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1, generator=torch.Generator().manual_seed(3))
    return model


def _step(model: nn.Module, dtype: str) -> tuple[float, dict[str, Tensor]]:
    """One update (two micro-batches of different widths): (policy loss, gradients)."""
    spec = GRPOSpec(micro_batch_size=4, dtype=dtype, learning_rate=1e-3)
    optimizer = build_optimizer(model, spec)
    grads: dict[str, Tensor] = {}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def keep(*_args: Any) -> None:
        grads.update({n: p.grad.clone() for n, p in named if p.grad is not None})

    optimizer.register_step_pre_hook(keep)
    batch = _batch()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    inputs = UpdateInputs(
        model=model,
        optimizer=optimizer,
        batch=batch,
        advantages=advantages,
        old_logprobs=None,
        ref_logprobs=None,
        pad_id=0,
        guard=NonFiniteGuard(lambda *a, **k: None),
        step=1,
        seed=0,
        collect_pre_update=False,
    )
    stats, _ = run_updates(inputs, spec)
    return stats.policy_loss, grads


@pytest.mark.parametrize(
    ("lora", "checkpointing", "dtype"),
    [
        (False, True, "float32"),
        (False, False, "float32"),
        (True, True, "float32"),
        (False, True, "bfloat16"),
    ],
)
def test_a_compiled_step_gives_the_eager_loss_and_gradients(
    lora: bool, checkpointing: bool, dtype: str
) -> None:
    eager_loss, eager_grads = _step(_model(lora, checkpointing), dtype)
    model = _model(lora, checkpointing)
    recorder = RecordingBackend()
    layers = compile_decoder_layers(model, backend=recorder)
    assert layers == decoder_layers(model) and len(layers) == 2
    assert all(is_compiled(layer) for layer in layers)
    loss, grads = _step(model, dtype)

    # What was built: the layers' forward and backward graphs, with the decoder's matmuls
    # and attention in them; the output head stays eager (no graph has the [rows, V] head).
    assert recorder.forward and recorder.backward
    forward_ops = _targets(recorder.forward)
    assert "aten.mm.default" in forward_ops or "aten.addmm.default" in forward_ops
    assert any("attention" in op for op in forward_ops), sorted(forward_ops)
    assert "aten.mm.default" in _targets(recorder.backward)
    vocab_sized = [
        node
        for graph in recorder.forward
        for node in graph.graph.nodes
        if VOCAB in tuple(getattr(node.meta.get("val"), "shape", ()))[-1:]
    ]
    assert not vocab_sized

    assert grads.keys() == eager_grads.keys() and grads
    assert loss == pytest.approx(eager_loss, rel=TOLERANCE, abs=TOLERANCE)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=TOLERANCE, atol=TOLERANCE)


def test_generation_with_a_kv_cache_runs_the_eager_forward() -> None:
    model: Any = tiny_llama(VOCAB)  # transformers' generate is typed for its mixin only
    assert enable_gradient_checkpointing(model)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    recorder = RecordingBackend()
    compile_decoder_layers(model, backend=recorder)
    with torch.no_grad():
        generated = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)
    assert not recorder.forward  # nothing compiled for the cached decode steps
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # a scoring pass is compiled
    assert recorder.forward


def test_a_deep_copy_of_a_compiled_model_computes_with_its_own_weights() -> None:
    """The transformers engine deep-copies the policy into its dtype, a merged export deep-
    copies the base: the copy's layers must run on the copy's weights."""
    model = _model(lora=False, checkpointing=False)
    recorder = RecordingBackend()
    compile_decoder_layers(model, backend=recorder)
    copied = copy.deepcopy(model)
    assert all(is_compiled(layer) for layer in decoder_layers(copied))
    with torch.no_grad():
        for param in decoder_layers(copied)[0].parameters():
            param.mul_(0.5)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    eager = copy.deepcopy(_model(lora=False, checkpointing=False))
    with torch.no_grad():
        for param in decoder_layers(eager)[0].parameters():
            param.mul_(0.5)
        expected = eager(input_ids=ids, use_cache=False).logits
        original = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(copied(input_ids=ids, use_cache=False).logits, expected)
    assert not torch.allclose(original, expected)
    assert recorder.forward  # the copy ran compiled


def test_compiling_twice_leaves_the_layers_compiled_once() -> None:
    model = _model(lora=False, checkpointing=False)
    recorder = RecordingBackend()
    first = [layer.forward for layer in compile_decoder_layers(model, backend=recorder)]
    again = [layer.forward for layer in compile_decoder_layers(model, backend=recorder)]
    assert first == again
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert len(recorder.forward) == 1  # one graph serves both layers (one class, one forward)


def test_the_default_backend_is_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(compiled_module.torch, "compile", fake_compile)
    compile_decoder_layers(_model(lora=False, checkpointing=False))
    assert COMPILE_BACKEND == "inductor"
    assert [kwargs["backend"] for kwargs in seen] == ["inductor"]  # the layers' one class


def test_what_cannot_compile_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo
    from torch._inductor import cpp_builder

    def no_compiler() -> str:
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    refusal = compile_refusal("cpu")
    assert refusal is not None and "C++ compiler" in refusal
    assert compile_refusal("cpu", "aot_eager") is None  # no C++ build: nothing to refuse
    real_find_spec = compiled_module.importlib.util.find_spec
    monkeypatch.setattr(
        compiled_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real_find_spec(name, *a),
    )
    refusal = compile_refusal("cuda")
    assert refusal is not None and "triton" in refusal
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    refusal = compile_refusal("cpu", "aot_eager")
    assert refusal is not None and "does not support this Python" in refusal


def test_a_run_that_cannot_compile_fails_before_loading_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(*_args: Any) -> Any:
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(run_setup, "compile_refusal", lambda *_a: "no C++ compiler here")
    monkeypatch.setattr(run_setup, "_load_policy", no_model)
    spec = JobSpec.model_validate(
        {
            "model": "tiny-random-llama",
            "dataset": {"rows": [{"prompt": "say a"}]},
            "graders": [{"type": "regex", "pattern": "7"}],
            "grpo": {"compile": True, "prompts_per_step": 1, "group_size": 2},
            "rollout": {"engine": "transformers"},
        }
    )
    with pytest.raises(CompileNotSupported, match=r"grpo\.compile: no C\+\+ compiler here") as info:
        train(spec, output_dir=tmp_path)
    assert info.value.reason == "compile_not_supported"
