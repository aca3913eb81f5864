"""Gradients are reduced once per minibatch, not once per micro-batch (issue 34, item 7): the
update turns FSDP2's gradient sync off for every micro-batch's backward but the minibatch's
last. Recorded on one process with a model that has FSDP2's switch; the 2-rank equivalence
tests (``tests/trainer/distributed/test_equivalence.py``) show the sums stay right."""

from __future__ import annotations

import torch
from torch import nn

from jobspec import GRPOSpec
from tests.trainer.conftest import tiny_llama
from trainer.update.batch import Batch, pack_batch
from trainer.update.policy_update import NonFiniteGuard, UpdateInputs, run_updates

VOCAB = 40


class _Switched(nn.Module):
    """A policy with FSDP2's ``set_requires_gradient_sync``: records the switch's state at
    every backward through the model."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_llama(VOCAB)
        self.sync = True
        self.at_backward: list[bool] = []
        self.inner.get_output_embeddings().weight.register_hook(self._seen)

    def _seen(self, grad: torch.Tensor) -> torch.Tensor:
        self.at_backward.append(self.sync)
        return grad

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.sync = requires

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.inner(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()  # type: ignore[no-any-return]

    def get_decoder(self) -> nn.Module:
        return self.inner.get_decoder()  # type: ignore[no-any-return]


def _batch(rows: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    return pack_batch(
        [torch.randint(1, VOCAB, (3,), generator=g).tolist() for _ in range(rows)],
        [torch.randint(1, VOCAB, (5,), generator=g).tolist() for _ in range(rows)],
        [None] * rows,
        [False] * rows,
        torch.ones(rows),
        torch.device("cpu"),
    )


def test_gradients_sync_in_the_last_micro_batch_of_each_minibatch_only() -> None:
    model, batch = _Switched(), _batch(8)
    spec = GRPOSpec(learning_rate=1e-3, micro_batch_size=2, mini_batch_size=4)
    run_updates(
        UpdateInputs(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=spec.learning_rate),
            batch=batch,
            advantages=torch.tensor([1.0, -1.0, 2.0, -2.0] * 2),
            step=1,
            seed=0,
            old_logprobs=torch.zeros(batch.size, batch.width),
            ref_logprobs=None,
            pad_id=0,
            guard=NonFiniteGuard(lambda *a, **k: None),
        ),
        spec,
    )
    # Two minibatches of two micro-batches each: off, on, off, on.
    assert model.at_backward == [False, True, False, True]
