"""Micro-batches keep order within their budget; packing pads right and fills defaults."""

from __future__ import annotations

import torch

from trainer.primitives.batch import micro_batches, pack
from trainer.primitives.losses import LOSSES
from trainer.primitives.validation import CheckedDatum


def test_micro_batches_keep_order_and_budget() -> None:
    assert micro_batches([5, 9, 3], 20) == [range(0, 2), range(2, 3)]
    assert micro_batches([5, 9, 3], 27) == [range(0, 3)]
    # A datum longer than the budget runs alone; nothing is dropped or reordered.
    assert micro_batches([30, 2, 2, 40], 10) == [range(0, 1), range(1, 3), range(3, 4)]
    assert micro_batches([], 10) == []


def _datum(n: int, **inputs: list[float]) -> CheckedDatum:
    return CheckedDatum(
        torch.arange(1, n + 1),
        torch.arange(2, n + 2),
        {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()},
    )


def test_pack_pads_right_and_fills_defaults_on_real_positions_only() -> None:
    data = [_datum(3, weights=[0.5, -1.0, 2.0]), _datum(1)]
    packed = pack(data, LOSSES["cross_entropy"], {}, torch.float32, "cpu")
    assert packed.tokens.tolist() == [[1, 2, 3], [1, 0, 0]]
    assert packed.targets.tolist() == [[2, 3, 4], [2, 0, 0]]
    assert packed.mask.tolist() == [[True, True, True], [True, False, False]]
    assert packed.lengths == [3, 1]
    # Absent weights are 1 on the datum's tokens, and padding weighs 0.
    assert packed.inputs["weights"].tolist() == [[0.5, -1.0, 2.0], [1.0, 0.0, 0.0]]
    assert packed.inputs["weights"].dtype == torch.float32


def test_per_token_thresholds_override_the_config_for_their_datum_only() -> None:
    ppo = LOSSES["ppo"]
    common = {"logprobs": [-1.0, -1.0], "advantages": [1.0, 1.0]}
    data = [_datum(2, **common, clip_low_threshold=[0.5, 0.6]), _datum(2, **common)]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    packed = pack(data, ppo, config, torch.float64, "cpu")
    assert packed.inputs["clip_low_threshold"].tolist() == [[0.5, 0.6], [0.9, 0.9]]
    assert packed.inputs["clip_high_threshold"].tolist() == [[1.1, 1.1], [1.1, 1.1]]
