"""A decoder's shape from its ``config.json``, and the parameter counts it implies.

Torch-free: the API plans a job's memory (:mod:`jobspec.memory_plan`) from these numbers before
any worker loads the model. The count is exact for the Llama-style decoders this service trains
(Llama, SmolLM, Mistral, Qwen2, Qwen3): token embeddings; per layer q/k/v/o projections (with
biases where the config asks: Qwen2's q/k/v, Llama's ``attention_bias`` on all four, Qwen3's
per-head q/k RMSNorms), the gated MLP (gate, up, down) and two RMSNorms; the final norm; and
an output head unless it is tied to the embeddings. Other architectures get the same formula
(``exact`` False).

The LoRA count follows peft's rule for the names :class:`jobspec.LoraSpec` takes: an adapter of
rank r on a linear layer of ``n_in -> n_out`` adds ``r * (n_in + n_out)`` parameters;
``all-linear`` is every linear layer of the decoder, the output head excepted.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jobspec.model_source import is_hub_repo_id

__all__ = [
    "EXACT_MODEL_TYPES",
    "PRESET_SHAPES",
    "Accelerator",
    "ModelShape",
    "UnsupportedConfig",
    "default_hub_cache",
    "detected_device_memory",
    "host_memory",
    "kv_bytes_per_token",
    "lookup_shape",
    "preset_shape",
    "read_model_shape",
    "workers_device",
]

Accelerator = Literal["cpu", "cuda"]
# Architectures whose parameter count the formula gives exactly.
EXACT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# The decoder's MLP linear layers, by the module names peft matches.
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


class UnsupportedConfig(ValueError):
    """A config.json without the fields a decoder's shape needs."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know of a decoder-only causal LM."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 0
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k
    model_type: str = "llama"

    @property
    def exact(self) -> bool:
        return self.model_type in EXACT_MODEL_TYPES

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's linear layers: name -> (in_features, out_features)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_linear_weights(self) -> int:
        """Weight elements of one layer's linear layers (biases not included)."""
        return sum(n_in * n_out for n_in, n_out in self.linear_shapes().values())

    def layer_other_parameters(self) -> int:
        """One layer's parameters outside the linear weights: biases and norms."""
        shapes = self.linear_shapes()
        biases = 0
        if self.qkv_bias:
            biases += sum(shapes[m][1] for m in ("q_proj", "k_proj", "v_proj"))
        if self.o_bias:
            biases += self.hidden_size
        if self.mlp_bias:
            biases += sum(shapes[m][1] for m in MLP_MODULES)
        norms = 2 * self.hidden_size + (2 * self.head_size if self.qk_norm else 0)
        return biases + norms

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_parameters(self) -> int:
        """The output head's own parameters: 0 when tied to the embeddings."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def linear_parameters(self) -> int:
        """Weights of the decoder's linear layers (what bfloat16 autocast computes in bfloat16)."""
        return self.num_hidden_layers * self.layer_linear_weights()

    @property
    def parameters(self) -> int:
        """Every parameter, as ``sum(p.numel() for p in model.parameters())`` counts them."""
        per_layer = self.layer_linear_weights() + self.layer_other_parameters()
        final_norm = self.hidden_size
        return (
            self.embedding_parameters
            + self.num_hidden_layers * per_layer
            + final_norm
            + self.head_parameters
        )

    def lora_parameters(self, rank: int, target_modules: list[str] | str = "all-linear") -> int:
        """Trainable parameters of rank-``rank`` adapters on ``target_modules`` (a list of
        module names, or ``all-linear``); names of no linear layer of the decoder add none."""
        shapes = self.linear_shapes()
        names = list(shapes) if isinstance(target_modules, str) else target_modules
        per_layer = sum(rank * sum(shapes[n]) for n in dict.fromkeys(names) if n in shapes)
        return self.num_hidden_layers * per_layer

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """A key and a value for every layer and KV head, per token."""
        return kv_bytes_per_token(
            self.num_hidden_layers, self.num_key_value_heads, self.head_size, itemsize
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape a Hugging Face ``config.json`` (as a dict) describes."""
        source = config.get("text_config") if "hidden_size" not in config else config
        if not isinstance(source, Mapping):
            raise UnsupportedConfig("config.json describes no decoder (no hidden_size)")
        missing = [k for k in _REQUIRED if not isinstance(source.get(k), int)]
        if missing:
            raise UnsupportedConfig(f"config.json lacks {', '.join(missing)}")
        model_type = str(source.get("model_type") or config.get("model_type") or "llama")
        heads = int(source["num_attention_heads"])
        attention_bias = bool(source.get("attention_bias", False))
        head_dim = int(source.get("head_dim") or 0)
        qwen2 = model_type == "qwen2"
        return cls(
            hidden_size=int(source["hidden_size"]),
            intermediate_size=int(source["intermediate_size"]),
            num_hidden_layers=int(source["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(source.get("num_key_value_heads") or heads),
            vocab_size=int(source["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            max_position_embeddings=int(source.get("max_position_embeddings") or 0),
            # 0 when it is the default (hidden_size // heads), as the presets write it
            head_dim=0 if head_dim == int(source["hidden_size"]) // heads else head_dim,
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(source.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The KV cache's bytes per token: a key and a value for every layer and KV head,
    ``2 * layers * kv_heads * head_dim * itemsize`` (46,080 for SmolLM2-135M in float32)."""
    return 2 * layers * kv_heads * head_dim * itemsize


def read_model_shape(folder: Path) -> ModelShape:
    """The shape of the model folder's ``config.json`` (OSError when unreadable,
    UnsupportedConfig when it is no decoder's)."""
    text = (folder / "config.json").read_text(encoding="utf-8")
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise UnsupportedConfig(f"config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise UnsupportedConfig("config.json is not a JSON object")
    return ModelShape.from_config(config)


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> ModelShape:
    return ModelShape(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=vocab == 151_936,  # the 0.5B (and 1.5B, 3B) tie, 7B and up do not
        max_position_embeddings=32_768,
        qkv_bias=True,
        model_type="qwen2",
    )


# Shapes known without a config.json: the packaged models (built on the workers, never on the
# API; tests/jobspec/test_model_shape.py checks them against the built folders) and the public
# config.json of Qwen2.5 models (the base and the Instruct models share their shape).
PRESET_SHAPES: dict[str, ModelShape] = {
    "tiny-random-llama": ModelShape(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=57,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "smollm2-135m-instruct": ModelShape(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49_152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen/qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151_936),
    "qwen/qwen2.5-7b": _qwen25(3584, 18_944, 28, 28, 4, 152_064),
    "qwen/qwen2.5-14b": _qwen25(5120, 13_824, 48, 40, 8, 152_064),
}


def preset_shape(model: str) -> ModelShape | None:
    """A packaged model's shape, or a Hub repo id's with a known public config (``-Instruct``
    shares its base's shape; the repo id's case is ignored, as the Hub does)."""
    key = model.lower()
    return PRESET_SHAPES.get(key) or PRESET_SHAPES.get(key.removesuffix("-instruct"))


def _hub_cache_config(repo_id: str, revision: str | None, hub_cache: Path) -> Path | None:
    """The cached config.json of a Hub repo at ``revision`` (a branch or tag through the
    cache's refs, or a commit), the way huggingface_hub lays its cache out; None when absent."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    ref = revision or "main"
    ref_file = repo / "refs" / ref
    commit = ref_file.read_text(encoding="utf-8").strip() if ref_file.is_file() else ref
    config = repo / "snapshots" / commit / "config.json"
    return config if "/" not in commit and config.is_file() else None


def lookup_shape(
    model: str,
    *,
    revision: str | None = None,
    roots: Sequence[str | Path] = (),
    forbidden: Sequence[str | Path] = (),
    hub_cache: Path | None = None,
) -> tuple[ModelShape | None, str | None]:
    """The shape of a job's ``model`` without loading it: the config.json of a model folder
    under ``roots`` (the rule of jobspec.paths), a packaged or known Hub model's preset, or the
    config.json in ``hub_cache`` (default: this machine's Hugging Face cache). Returns
    ``(shape, None)``, or ``(None, reason)`` when no config.json can be read here."""
    from jobspec.paths import allowed_model_folder

    folder = None
    if model not in PRESET_SHAPES and not is_hub_repo_id(model):
        folder = allowed_model_folder(model, roots, forbidden)
    hub_cache = hub_cache or default_hub_cache()
    try:
        if folder is not None:
            return read_model_shape(folder), None
        preset = preset_shape(model)
        if preset is not None:
            return preset, None
        config = _hub_cache_config(model, revision, hub_cache) if is_hub_repo_id(model) else None
        if config is not None:
            return read_model_shape(config.parent), None
    except (OSError, UnsupportedConfig) as exc:
        return None, f"the model's config.json cannot be read: {exc}"
    return None, (
        f"no config.json of {model!r} is available to the API (a Hub model not in its Hugging "
        "Face cache): its memory is checked on the worker"
    )


def default_hub_cache() -> Path:
    """Where huggingface_hub caches Hub models: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (read without importing huggingface_hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return Path(home).expanduser() / "hub"


@functools.cache
def detected_device_memory() -> tuple[int, Accelerator]:
    """The memory of this machine's first CUDA device (``nvidia-smi``, so nothing imports
    torch), else the host's memory; and which of the two it is. Read once per process."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        if out and out[0].isdigit():
            return int(out[0]) << 20, "cuda"  # MiB
    except (OSError, subprocess.SubprocessError):
        pass
    return host_memory(), "cpu"


def workers_device(
    memory_gib: float | None,
    kind: Accelerator | None,
    announced: tuple[int, Accelerator] | None = None,
) -> tuple[int, Accelerator]:
    """The workers' device a job's memory plan is for: the bytes and the kind the operator
    declared (``GRPO_WORKER_DEVICE_MEMORY_GIB``, ``GRPO_WORKER_DEVICE_KIND``); each one left
    unset is the one the job's workers ``announced`` (their device's bytes and kind, written
    with their size class), else the one detected on this host (:func:`detected_device_memory`).
    The kind decides as much as the size: a CUDA worker rolls out in bfloat16 with 16-token KV
    blocks and its engine sleeps through the update; a CPU plan of the same job counts float32
    rollouts, twice the KV bytes and no sleep. So an API on a host without the workers' GPUs
    must not plan from its own host while the workers say what they have. An announced size
    counts only for the kind the plan is for (a CPU worker's RAM is no GPU's memory)."""
    if memory_gib is not None and kind is not None:
        return int(memory_gib * (1 << 30)), kind
    chosen = kind or (announced[1] if announced is not None else None)
    if memory_gib is not None:
        memory = int(memory_gib * (1 << 30))
    elif announced is not None and announced[1] == chosen:
        memory = announced[0]
    else:
        memory = detected_device_memory()[0]
    return memory, chosen or detected_device_memory()[1]


def host_memory() -> int:
    """This machine's physical memory in bytes (what a CPU job's plan fits)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
