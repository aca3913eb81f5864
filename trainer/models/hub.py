"""Hugging Face Hub models by repo id, read through the worker's Hugging Face cache.

``resolve_hub_model("Qwen/Qwen2.5-0.5B-Instruct", "main")`` returns the cache's snapshot folder
of that revision (a plain Hugging Face folder: config, tokenizer, safetensors weights), which
:func:`trainer.models.loading.load_policy` and the rollout engines load like any other folder.

- The cache is the standard one: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``, read when a model is resolved (not when this module is imported).
- Offline (``HF_HUB_OFFLINE`` set, which :mod:`trainer.models.loading` does unless the operator set it
  to ``0``): only the cache is read. A model or revision that is not there fails with
  :class:`~trainer.errors.ModelNotCached`, whose message names the repo id, the revision and
  the command that pre-fetches it. Online: the model's files are downloaded into the cache
  first (configuration, tokenizer, safetensors weights; top-level files only, never pickled
  ``.bin`` weights).
- A snapshot without a ``config.json`` or without safetensors weights (an interrupted or
  partial download) is refused the same way rather than failing later inside transformers.

Messages name no server path: users read them in their job's failure message.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from trainer.errors import ModelNotCached, ModelNotFound

__all__ = [
    "DEFAULT_REVISION",
    "HUB_FILE_PATTERNS",
    "hub_cache_dir",
    "hub_offline",
    "prefetch_command",
    "resolve_hub_model",
]

DEFAULT_REVISION = "main"
# What a worker downloads of a repo: enough to load it with transformers and vLLM.
HUB_FILE_PATTERNS = (
    "*.json",  # config, generation config, tokenizer files, safetensors index
    "*.safetensors",
    "*.model",  # sentencepiece tokenizers
    "*.tiktoken",
    "*.txt",  # merges.txt, vocab.txt
    "*.jinja",  # chat templates kept in a file of their own
)
# Only top-level files: subfolders hold other formats (original/, onnx/, gguf/...).
_IGNORE_PATTERNS = ("*/*",)
_TRUE = {"1", "on", "yes", "true"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache this process uses, from the environment as it is now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def hub_offline() -> bool:
    """Whether the Hub may not be contacted (``HF_HUB_OFFLINE``, as set now or at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)


def prefetch_command(repo_id: str, revision: str) -> str:
    """The command an operator runs, where the worker's cache is, to put a model in it."""
    return f"HF_HOME=<the worker's HF_HOME> hf download {repo_id} --revision {revision}"


def _not_cached(repo_id: str, revision: str, why: str) -> ModelNotCached:
    return ModelNotCached(
        f"model {repo_id} (revision {revision}) {why}. Pre-fetch it into the worker's Hugging "
        f"Face cache: `{prefetch_command(repo_id, revision)}`, then run the job again."
    )


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (default ``main``) in this process's
    Hugging Face cache, downloaded first when the Hub may be contacted.

    Raises ModelNotCached (not in the cache, incomplete there, or the Hub unreachable) or
    ModelNotFound (the Hub has no such repo or revision for this worker)."""
    rev = revision or DEFAULT_REVISION
    offline = hub_offline()
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=rev,
                cache_dir=hub_cache_dir(),
                local_files_only=offline,
                allow_patterns=list(HUB_FILE_PATTERNS),
                ignore_patterns=list(_IGNORE_PATTERNS),
            )
        )
    except LocalEntryNotFoundError as exc:  # missing, or (newer huggingface_hub) partial
        why = (
            "is not (or only partly) in this worker's Hugging Face cache, and this worker "
            "does not download models (HF_HUB_OFFLINE is set)"
            if offline
            else "is not (or only partly) in this worker's Hugging Face cache and the Hub "
            "could not be reached"
        )
        raise _not_cached(repo_id, rev, why) from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFound(f"model {repo_id} has no revision {rev} on the Hub") from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelNotFound(
            f"model {repo_id} is not on the Hub, or this worker may not read it (a private or "
            "gated repo needs the operator's access token on the worker)"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code
        raise _not_cached(
            repo_id, rev, f"could not be downloaded from the Hub (HTTP {status})"
        ) from exc
    if not (folder / "config.json").is_file():
        raise _not_cached(repo_id, rev, "has no config.json in this worker's cache")
    if not any(folder.glob("*.safetensors")):
        raise _not_cached(repo_id, rev, "has no safetensors weights in this worker's cache")
    return folder
