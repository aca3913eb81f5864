"""The client of a rollout server (:mod:`trainer.rollout.rollout_server`): a
:class:`~trainer.rollout.base.RolloutEngine` whose engine runs in a process of its own, so the
trainer can update while it generates (asynchronous GRPO, docs/trainer.md).

Weights travel as files, never through the server's socket: ``sync_weights`` and
``load_weight_buckets`` WRITE the weights as version :attr:`RemoteEngine.publish_version`
(safetensors, one file per bucket, in a folder renamed into place whole) and return without
asking anything of the server, which may be generating. A ``generate`` names the version it
wants; the server loads that version's files first when it holds another. So a producer
generating with an older version and an evaluation of the newest can share one server, and a
server started afresh can load any version still published.

Restart: when the server process dies (a connection refused or reset, an answer cut off), the
client starts a new one (same config, new secret and port) and retries the interrupted call
once; the retry names the same version and seed, so it returns what the first try would have.
A server that cannot start, or dies again during the retry, raises
:class:`RolloutServerError`. ``close()`` (and interpreter exit) stops the server and removes
its folder; the server also exits by itself when the trainer process is gone.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobspec.traits import ROLLOUT_ENGINE_TRAITS
from trainer.distributed.weights import bucketed
from trainer.rollout.base import Completion, PrefillCounts, torch_dtype
from trainer.rollout.rollout_server import (
    SECRET_HEADER,
    RolloutServerConfig,
    RolloutServerError,
    RolloutServerKilled,
    ServerProcess,
    launch,
)
from trainer.rollout.weight_versions import DEFAULT_BUCKET_BYTES, PublishedVersions, policy_tensors

__all__ = [
    "RemoteEngine",
    "RolloutServerError",
    "RolloutServerKilled",
    "VersionView",
]

# A server killed by a signal while it starts is started again, this many tries in all.
START_ATTEMPTS = 3
# How many times one call may find its server dead and start a new one before it fails.
RESTARTS_PER_CALL = 2


class _ServerGone(Exception):
    """The connection failed: the server process is gone (or going)."""


@dataclass
class _Owned:
    """What the finalizer cleans up; holds no reference to the client."""

    root: Path
    server: ServerProcess | None = None


class RemoteEngine:
    """A rollout engine in a server process it starts (module docstring).

    ``publish_version``: the version the next ``sync_weights``/``load_weight_buckets``
    publishes as (then one more); versions must grow. ``restarts``: servers started again
    after one died. ``max_model_len``, ``stop_token_ids`` and ``prefill`` (None when the
    engine does not count prefix-cache hits) are the served engine's."""

    def __init__(
        self,
        config: RolloutServerConfig,
        *,
        publish_version: int = 1,
        root: Path | None = None,
        start_timeout_s: float = 600.0,
        call_timeout_s: float | None = None,
        stop_timeout_s: float = 10.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.config = config
        self.restarts = 0
        self._start_timeout_s = start_timeout_s
        self._call_timeout_s = call_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._bucket_bytes = bucket_bytes
        self._dtype = torch_dtype(config.dtype)
        self._adapters = config.lora_rank is not None and (
            ROLLOUT_ENGINE_TRAITS[config.engine].serves_lora_adapters  # type: ignore[index]
        )
        self._root = Path(tempfile.mkdtemp(prefix="rollout-server-", dir=root))
        self.versions = PublishedVersions(
            self._root / "versions",
            base_version=config.base_version,
            adapters=self._adapters,
            publish_version=publish_version,
        )
        self._starting = threading.Lock()  # one restart at a time
        self._local = threading.local()  # each thread's prefix-cache block
        self._owned = _Owned(self._root)
        self._finalizer = weakref.finalize(self, _clean_up, self._owned, stop_timeout_s)
        try:
            self._owned.server = self._launch()
            info = self.health()
        except BaseException:
            self._finalizer()
            raise
        self.max_model_len: int = int(info["max_model_len"])
        self.stop_token_ids: list[int] | None = info["stop_token_ids"]
        self.prefill: PrefillCounts | None = PrefillCounts() if info["prefill"] else None

    # ------------------------------------------------------------------ RolloutEngine

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
        version: int | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt with the weights of ``version`` (None: the
        newest published, else the base); each completion carries its ``policy_version``."""
        wanted = self.versions.resolve(version)
        answer = self._call(
            "/generate",
            {
                "prompts": [list(p) for p in prompts],
                "n": n,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seed,
                "greedy": greedy,
                "version": wanted,
                "cache_block": getattr(self._local, "block", None),
            },
        )
        if answer["policy_version"] != wanted:
            raise RolloutServerError(
                f"asked for version {wanted}, served {answer['policy_version']}"
            )
        counted = answer.get("prefill")
        if self.prefill is not None and counted:
            self.prefill.prompt_tokens += int(counted["prompt_tokens"])
            self.prefill.cached_tokens += int(counted["cached_tokens"])
        return [[Completion(**c) for c in group] for group in answer["completions"]]

    def sync_weights(self, model: nn.Module) -> float:
        """Publish ``model``'s weights as :attr:`publish_version`: the engine's weights under
        their Hugging Face names (LoRA merged in float32), or with an adapter engine the LoRA
        adapter's tensors and peft config; in the engine's dtype. Seconds spent writing."""
        start = time.perf_counter()
        tensors, config = policy_tensors(model, self._dtype, adapters=self._adapters)
        self.versions.publish(bucketed(tensors, self._bucket_bytes), config)
        return time.perf_counter() - start

    def load_weight_buckets(
        self,
        buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        adapter_config: Any = None,
    ) -> float:
        """``StreamedSync``: publish streamed buckets as :attr:`publish_version`, each bucket
        written to its file before the next is asked for. Seconds spent (gathers included)."""
        start = time.perf_counter()
        self.versions.publish(buckets, adapter_config)
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the server (terminate, then kill) and remove every file of the client."""
        self._finalizer()

    # ------------------------------------------------------------------ versions

    @property
    def publish_version(self) -> int:
        """The version the next sync publishes as (then one more); the caller may set it (a
        resumed run: the restored step), above every version published so far."""
        return self.versions.publish_version

    @publish_version.setter
    def publish_version(self, version: int) -> None:
        self.versions.publish_version = version

    def at_version(self, version: int) -> VersionView:
        """A RolloutEngine whose generate names ``version`` (a producer's older policy)."""
        return VersionView(self, version)

    def forget_versions_below(self, version: int) -> None:
        """Delete the files of every published version below ``version`` (see
        :meth:`PublishedVersions.forget_below`)."""
        self.versions.forget_below(version)

    def load_version(self, version: int) -> None:
        """Have the server load ``version`` now, ahead of the calls that name it."""
        self._call("/load", {"version": self.versions.resolve(version)})

    def health(self) -> dict[str, Any]:
        """The server's ``/health``: version held, pid, calls in flight."""
        return self._call("/health", None)

    @contextmanager
    def keep_prefix_cache(self) -> Iterator[None]:
        """This thread's calls in the block keep the engine's prefix cache between them
        (:func:`trainer.rollout.base.prefix_cache_kept`); cleared once, at the block's first."""
        previous = getattr(self._local, "block", None)
        self._local.block = secrets.token_hex(8)
        try:
            yield
        finally:
            self._local.block = previous

    @property
    def pid(self) -> int | None:
        """The running server's process id (None once closed)."""
        server = self._owned.server
        return server.popen.pid if server is not None else None

    @property
    def folder(self) -> Path:
        """The client's folder: the server's config and log, the published versions."""
        return self._root

    # ------------------------------------------------------------------ the process

    def _launch(self) -> ServerProcess:
        """A started server. One killed by a signal while it starts (a fault, not its own
        exit) is started again, up to :data:`START_ATTEMPTS` times in all."""
        config = dataclasses.replace(self.config, weights_dir=str(self.versions.folder))
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return launch(config, self._root, timeout_s=self._start_timeout_s)
            except RolloutServerKilled:
                if attempt == START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _call(self, path: str, payload: dict[str, Any] | None) -> Any:
        """One request; when the server is gone, a new server and the same request again, up
        to :data:`RESTARTS_PER_CALL` times (a server that keeps dying fails the call with
        RolloutServerKilled, which the worker retries from the job's last checkpoint)."""
        server = self._current()
        for restart in range(RESTARTS_PER_CALL + 1):
            try:
                return self._request(server, path, payload)
            except _ServerGone as exc:
                if restart == RESTARTS_PER_CALL:
                    raise RolloutServerKilled(
                        f"the rollout server died {RESTARTS_PER_CALL + 1} times during one call "
                        f"({exc}); its output ends:\n{server.tail()}"
                    ) from exc
                server = self._replace(server)
        raise AssertionError("unreachable")

    def _current(self) -> ServerProcess:
        server = self._owned.server
        if not self._finalizer.alive:
            raise RolloutServerError("the remote engine is closed")
        if server is None:
            raise RolloutServerError("the rollout server could not be started again")
        return server

    def _replace(self, dead: ServerProcess) -> ServerProcess:
        """A new server in place of ``dead`` (once, whichever thread saw it die first)."""
        with self._starting:
            current = self._current()
            if current is dead:
                dead.stop(self._stop_timeout_s)
                self._owned.server = None
                self._owned.server = current = self._launch()
                self.restarts += 1
            return current

    def _request(self, server: ServerProcess, path: str, payload: dict[str, Any] | None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        if body is not None and len(body) > self.config.max_body_bytes:
            # Sent anyway, the server would refuse it unread and reset the connection.
            raise ValueError(
                f"a {path} request of {len(body)} bytes is over the server's max_body_bytes "
                f"({self.config.max_body_bytes}): split the call"
            )
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=self._call_timeout_s)
        try:
            conn.request(
                "GET" if body is None else "POST",
                path,
                body=body,
                headers={SECRET_HEADER: server.secret, "Content-Type": "application/json"},
            )
            response = conn.getresponse()
            data = response.read()
        except (ConnectionError, http.client.HTTPException) as exc:
            raise _ServerGone(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise RolloutServerError(f"no answer within {self._call_timeout_s}s to {path}") from exc
        finally:
            conn.close()
        return _answer(response.status, data, path)


class VersionView:
    """A :class:`~trainer.rollout.base.RolloutEngine` view of a :class:`RemoteEngine` whose
    ``generate`` names one version. It owns nothing: ``close`` does nothing, and it cannot
    publish (``sync_weights`` raises; publish through the client)."""

    def __init__(self, client: RemoteEngine, version: int) -> None:
        self.client = client
        self.version = version

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def prefill(self) -> PrefillCounts | None:
        return self.client.prefill

    def keep_prefix_cache(self) -> Any:
        return self.client.keep_prefix_cache()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        return self.client.generate(
            prompts,
            n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            greedy=greedy,
            version=self.version,
        )

    def sync_weights(self, model: nn.Module) -> float:
        raise TypeError(f"a view at version {self.version} cannot publish; use its client")

    def close(self) -> None:
        pass


def _answer(status: int, data: bytes, path: str) -> Any:
    """The decoded answer of a 200; a 400 as ValueError (the caller's mistake, as the
    in-process engines raise it), anything else as RolloutServerError."""
    try:
        answer = json.loads(data) if data else {}
    except ValueError:
        answer = {"error": data[:500].decode(errors="replace")}
    if status == 200:
        return answer
    message = answer.get("error", "") if isinstance(answer, dict) else str(answer)
    if status == 400:
        raise ValueError(f"the rollout server refused {path}: {message}")
    raise RolloutServerError(f"the rollout server answered {status} to {path}: {message}")


def _clean_up(owned: _Owned, timeout: float) -> None:
    """The finalizer (close, garbage collection, interpreter exit): no server, no files."""
    server, owned.server = owned.server, None
    if server is not None:
        server.stop(timeout)
    shutil.rmtree(owned.root, ignore_errors=True)
