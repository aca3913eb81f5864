"""The session's adapters: the parts Tinker names, a peft folder that loads elsewhere with the
same outputs, and snapshots that round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from tests.trainer.primitives.conftest import new_session, trainable
from trainer.models.loading import load_policy
from trainer.primitives import PrimitiveError, ResidentModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}


def _adapted(session: ResidentModel) -> set[str]:
    """The module leaf names that carry adapters."""
    return {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable(session)}


@pytest.mark.parametrize(
    ("flags", "modules"),
    [
        ({}, ATTENTION | MLP | {"lm_head"}),
        ({"train_mlp": False, "train_unembed": False}, ATTENTION),
        ({"train_attn": False, "train_unembed": False}, MLP),
        ({"train_attn": False, "train_mlp": False}, {"lm_head"}),
    ],
)
def test_the_parts_asked_for_and_only_they_get_adapters(
    tiny_path: Path, flags: dict[str, bool], modules: set[str]
) -> None:
    session = ResidentModel(tiny_path, lora_rank=2, **flags)
    assert _adapted(session) == modules
    names = trainable(session)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_nothing_to_train_is_refused(tiny_path: Path) -> None:
    with pytest.raises(PrimitiveError, match="train_attn, train_mlp, train_unembed"):
        ResidentModel(
            tiny_path, lora_rank=2, train_attn=False, train_mlp=False, train_unembed=False
        )


def test_the_same_seed_makes_the_same_adapters_and_keeps_the_global_stream(tiny_path: Path) -> None:
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    a = ResidentModel(tiny_path, lora_rank=2, seed=11)
    assert torch.equal(torch.rand(3), expected_draw)  # building consumed no global randomness
    b = ResidentModel(tiny_path, lora_rank=2, seed=11)
    for x, y in zip(trainable(a).values(), trainable(b).values(), strict=True):
        assert torch.equal(x, y)


# peft warns that a tied head is adapted: it matters to a merge, not to loading the adapter.
@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
def test_the_adapter_folder_loads_with_peft_and_computes_what_the_session_does(
    tiny_path: Path, tmp_path: Path
) -> None:
    session = new_session(tiny_path, base_model="tiny-random-llama")
    session.save_adapter(tmp_path / "sampler")
    config = json.loads((tmp_path / "sampler" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-random-llama"

    base, _ = load_policy(tiny_path)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "sampler")).eval()
    ids = torch.tensor([[2, 10, 20, 30, 40, 3]])
    with torch.no_grad():
        want = session.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        plain = load_policy(tiny_path)[0](input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert (want - plain).abs().max() > 1e-2  # the adapters do change the model


def test_a_saved_adapter_reads_back_as_the_snapshot_it_was(tiny_path: Path, tmp_path: Path) -> None:
    session = new_session(tiny_path)
    snapshot = session.snapshot()
    session.save_adapter(tmp_path / "sampler")
    read = session.load_snapshot(tmp_path / "sampler")
    assert read.tensors.keys() == snapshot.tensors.keys()
    assert all(torch.equal(read.tensors[k], v) for k, v in snapshot.tensors.items())

    other_rank = ResidentModel(tiny_path, lora_rank=8)
    with pytest.raises(PrimitiveError, match=r"path: adapter tensor .* has shape"):
        other_rank.load_snapshot(tmp_path / "sampler")
    with pytest.raises(PrimitiveError, match="path: no readable adapter"):
        session.load_snapshot(tmp_path)


def test_a_snapshot_of_another_shape_is_refused_before_any_weight_moves(tiny_path: Path) -> None:
    session = new_session(tiny_path)
    before = {n: p.detach().clone() for n, p in trainable(session).items()}
    foreign = ResidentModel(tiny_path, lora_rank=8).snapshot()
    with pytest.raises(ValueError, match="not this model's trainable parameters"):
        session.sample([2, 10], 1, max_tokens=2, weights=foreign)
    assert all(torch.equal(p, before[n]) for n, p in trainable(session).items())
