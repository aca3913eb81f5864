"""The calls of a Tinker training model, applied to the model its worker holds resident
(worker/tinker_model.py): one method per request ``kind``, each from the request's ``body``
(JSON, or protobuf for forward_backward) to the bytes ``retrieve_future`` returns. Saves are
written by worker.tinker_saves.

A call the user got wrong (a bad tensor, an unknown loss, a duplicate save name, a sampler of
another model) fails as a ``user`` error with a message meant for them; anything else fails as a
``server`` error whose details are logged under a reference, since the message may name server
paths. Either way the model stays loaded and the next call is applied.
"""

from __future__ import annotations

import gc
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import session_scope
from app.tinker import names, schemas
from app.tinker import repository as repo
from app.tinker import worker_repository as q
from app.tinker.states import RequestKind
from app.tinker.wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from app.tinker.worker_repository import ModelRef, QueuedRequest
from trainer.primitives import Datum, PrimitiveError, ResidentModel, WeightsSnapshot
from worker import tinker_saves as saves
from worker.settings import WorkerSettings
from worker.tinker_saves import RequestRefused

log = logging.getLogger(__name__)


# The errors that are the caller's: their messages are ours and name the field at fault.
USER_ERRORS: tuple[type[Exception], ...] = (
    RequestRefused,
    PrimitiveError,
    WireError,
    ValidationError,
)
# Sampler weights kept in memory: rl_loop saves new ones every batch and samples only the
# newest, so older ones are dropped (a named save is read back from its folder when sampled).
MAX_SNAPSHOTS = 8


@dataclass(frozen=True)
class Outcome:
    """A call's result (bytes and their format, json or proto), or its error and category."""

    result: bytes | None = None
    result_format: str | None = None
    error: str | None = None
    category: str | None = None


def _refuse_unsupported(request: schemas.SampleRequest) -> None:
    """The sampling options this server does not compute: refused, as the SDK raises on a
    reply that lacks what it asked for."""
    asked = {
        "topk_prompt_logprobs": request.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": request.topk_sample_logprobs > 0,
        "prompt_alt_tokens_k": request.prompt_alt_tokens_k > 0,
        "target_prompt_logprobs": request.target_prompt_logprobs is not None,
        "prompt_logprobs_last_n": request.prompt_logprobs_last_n is not None,
        "record_stability_info": bool(request.record_stability_info),
    }
    refused = [name for name, on in asked.items() if on]
    if refused:
        raise RequestRefused(f"{', '.join(refused)}: not supported by this server")


def _json(value: dict[str, Any]) -> tuple[bytes, str]:
    return json.dumps(value).encode(), "json"


# The method applying each kind of call (app.tinker.states.RequestKind, what the routes store).
HANDLERS: dict[RequestKind, str] = {
    "create_model": "_create_model",
    "load_weights": "_load_weights",
    "forward_backward": "_forward_backward",
    "forward": "_forward",
    "optim_step": "_optim_step",
    "save_weights": "_save_weights",
    "save_weights_for_sampler": "_save_for_sampler",
    "sample": "_sample",
}


class HeldModel:
    """A training model resident on this worker and the sampler weights saved from it."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        settings: WorkerSettings,
        ref: ModelRef,
        resident: ResidentModel,
        folder: Path,
    ) -> None:
        self._sessions = sessions
        self._settings = settings
        self.ref = ref
        self.resident: ResidentModel | None = resident
        self.folder = folder  # the base model's
        self.last_saved_path: str | None = None
        self.snapshots: OrderedDict[str, WeightsSnapshot] = OrderedDict()

    @property
    def _model(self) -> ResidentModel:
        assert self.resident is not None, "the model was closed"
        return self.resident

    def close(self) -> None:
        """Drop the model and its snapshots, and give their memory back."""
        self.snapshots.clear()
        self.resident = None
        gc.collect()  # peft modules hold reference cycles: freed only by the collector
        if self._settings.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def suspend(self, folder: Path) -> None:
        """The whole model, with the sampler weights it keeps, into ``folder`` (an idle
        release: worker.tinker_idle); :meth:`restore_snapshots` puts them back."""
        self._model.suspend(folder, self.snapshots)

    def restore_snapshots(self, snapshots: Mapping[str, WeightsSnapshot]) -> None:
        for key, snapshot in snapshots.items():
            self._keep(key, snapshot)

    def apply(self, request: QueuedRequest) -> Outcome:
        """Apply one call; never raises."""
        try:
            method = HANDLERS.get(cast(RequestKind, request.kind))  # the row's kind, as stored
            if method is None:
                raise RequestRefused(f"unknown call {request.kind!r}")
            handler: Callable[[bytes], tuple[bytes, str]] = getattr(self, method)
            result, result_format = handler(request.body)
            return Outcome(result=result, result_format=result_format)
        except USER_ERRORS as exc:
            return Outcome(error=f"{request.kind}: {exc}"[:4000], category="user")
        except Exception as exc:
            reference = secrets.token_hex(6)
            log.error(
                "tinker model %s: %s %s failed (reference %s)",
                self.ref.id,
                request.kind,
                request.request_id,
                reference,
                exc_info=exc,
            )
            message = (
                f"{request.kind}: internal error ({type(exc).__name__}, reference {reference}); "
                "the operator's worker log has the details"
            )
            return Outcome(error=message, category="server")

    # ---------------------------------------------------------------- creation

    def _create_model(self, _body: bytes) -> tuple[bytes, str]:
        return _json({"model_id": self.ref.id, "type": "create_model"})

    def _load_weights(self, body: bytes) -> tuple[bytes, str]:
        """The first call of a model created from a saved state (loaded at the start), or
        the legacy load into this model (``TrainingClient.load_state``)."""
        request = schemas.LoadWeightsRequest.model_validate_json(body)
        if not request.creates_model:  # the legacy form: this model's weights are replaced
            folder = saves.saved_folder(self._sessions, self.ref, request.path, "weights")
            # Loaded beside the current model, then swapped: a load that fails (a save that
            # does not fit) leaves the model as it was, at the price of a moment's two copies.
            loaded = ResidentModel.load_state(
                folder, self.folder, optimizer=request.optimizer, device=self._settings.device
            )
            self.resident = loaded
            gc.collect()
        self._saved(request.path)
        return _json({"model_id": self.ref.id, "path": request.path, "type": "load_weights"})

    # ---------------------------------------------------------------- training

    def _forward_backward(self, body: bytes) -> tuple[bytes, str]:
        return self._fwdbwd(body, forward_only=False)

    def _forward(self, body: bytes) -> tuple[bytes, str]:
        return self._fwdbwd(body, forward_only=True)

    def _fwdbwd(self, body: bytes, *, forward_only: bool) -> tuple[bytes, str]:
        settings = self._settings
        request = decode_forward_backward(
            body,
            max_bytes=settings.tinker_max_body_bytes,
            max_datums=settings.tinker_max_chunk_datums,
            max_tokens=settings.tinker_max_tokens_per_call,
        )
        if request.model_id != self.ref.id:
            raise RequestRefused(f"the call is for model {request.model_id!r}, not this one")
        data = [Datum(tokens=d.tokens, inputs=d.inputs) for d in request.data]
        # A text config value (loss_fn_config_v2) is refused by the primitive, naming the key.
        config = cast(Mapping[str, float], request.config)
        result = self._model.forward_backward(
            data, request.loss_fn, config, forward_only=forward_only
        )
        return encode_forward_backward_output(result.logprobs, result.metrics), "proto"

    def _optim_step(self, body: bytes) -> tuple[bytes, str]:
        request = schemas.OptimStepRequest.model_validate_json(body)
        adam = request.adam_params
        if adam is None:
            family = request.optimizer_params.type if request.optimizer_params else "none"
            raise RequestRefused(
                f"optimizer {family!r}: only Adam (adam_params) is supported by this server"
            )
        metrics = self._model.optim_step(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
        return _json({"metrics": dict(metrics)})

    # ---------------------------------------------------------------- saves

    def _save_weights(self, body: bytes) -> tuple[bytes, str]:
        request = schemas.SaveWeightsRequest.model_validate_json(body)
        if request.path is None:
            raise RequestRefused("path: the name of the save is required")
        path = self._save(
            "weights",
            request.path,
            overwrite=request.overwrite,
            ttl_seconds=request.ttl_seconds,
            user_metadata=request.user_metadata,
        )
        return _json({"path": path, "type": "save_weights"})

    def _save_for_sampler(self, body: bytes) -> tuple[bytes, str]:
        request = schemas.SaveWeightsForSamplerRequest.model_validate_json(body)
        if request.path is not None:
            path = self._save(
                "sampler_weights",
                request.path,
                overwrite=True,  # sampler weights are always ephemeral in Tinker
                ttl_seconds=request.ttl_seconds,
                user_metadata=request.user_metadata,
            )
            self._keep(path, self._model.snapshot())
            return _json({"path": path, "type": "save_weights_for_sampler"})
        assert request.sampling_session_seq_id is not None  # the request model checked
        sampler = names.sampler_id(self.ref.session_id, request.sampling_session_seq_id)
        self._keep(sampler, self._model.snapshot())
        return _json({"sampling_session_id": sampler, "type": "save_weights_for_sampler"})

    def _save(
        self,
        kind: str,
        name: str,
        *,
        overwrite: bool,
        ttl_seconds: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> str:
        """A save of the model (``weights``: state and optimizer; ``sampler_weights``: the
        adapter), written and recorded; its tinker path."""
        model = self._model
        path = saves.write_save(
            self._sessions,
            self._settings,
            self.ref,
            kind,
            name,
            model.save_state if kind == "weights" else model.save_adapter,
            overwrite=overwrite,
            ttl_seconds=ttl_seconds,
            user_metadata=user_metadata,
        )
        if kind == "weights":
            self.last_saved_path = path
        return path

    def _saved(self, path: str) -> None:
        """The model holds the state saved at ``path`` (it was loaded from it)."""
        with session_scope(self._sessions) as db:
            q.set_last_saved(db, model_id=self.ref.id, owner=self.ref.owner, path=path)
        self.last_saved_path = path

    # ---------------------------------------------------------------- sampling

    def _keep(self, key: str, snapshot: WeightsSnapshot) -> None:
        self.snapshots[key] = snapshot
        self.snapshots.move_to_end(key)
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self.snapshots.popitem(last=False)

    def _sampler_weights(self, sampler_id: str) -> WeightsSnapshot | None:
        with session_scope(self._sessions) as db:
            sampler = repo.get_sampler(db, project_id=self.ref.project_id, sampler_id=sampler_id)
        if sampler is None or sampler.model_id != self.ref.id:
            raise RequestRefused(f"no sampling session {sampler_id!r} on this model")
        if names.is_base_sampler_model(self.ref.id):
            return None  # the model's own weights: adapters never trained, the base model
        key = sampler.model_path or sampler.id
        snapshot = self.snapshots.get(key)
        if snapshot is None and sampler.model_path is not None:
            folder = saves.saved_folder(
                self._sessions, self.ref, sampler.model_path, "sampler_weights"
            )
            snapshot = self._model.load_snapshot(folder)
        if snapshot is None:
            raise RequestRefused(
                f"the weights of sampling session {sampler_id} were released (this model keeps "
                f"its newest {MAX_SNAPSHOTS} saves for sampling); save them again"
            )
        self._keep(key, snapshot)
        return snapshot

    def _sample(self, body: bytes) -> tuple[bytes, str]:
        settings = self._settings
        request = schemas.SampleRequest.model_validate_json(body)
        _refuse_unsupported(request)
        if request.sampling_session_id is None:
            raise RequestRefused("sampling_session_id is required")
        if request.num_samples > settings.tinker_max_samples_per_call:
            raise RequestRefused(
                f"num_samples {request.num_samples} is over this server's "
                f"{settings.tinker_max_samples_per_call}"
            )
        params = request.sampling_params
        max_tokens = params.max_tokens or settings.tinker_max_sample_tokens
        if max_tokens > settings.tinker_max_sample_tokens:
            raise RequestRefused(
                f"sampling_params.max_tokens {max_tokens} is over this server's "
                f"{settings.tinker_max_sample_tokens}"
            )
        prompt = request.prompt.token_ids()
        if len(prompt) > settings.tinker_max_tokens_per_call:
            raise RequestRefused(
                f"the prompt's {len(prompt)} tokens are over this server's "
                f"{settings.tinker_max_tokens_per_call}"
            )
        stop = params.stop
        # None: the model's own stop tokens; [] none at all; else strings or token ids.
        stop_strings: list[str] = [stop] if isinstance(stop, str) else []
        stop_tokens: list[int] | None = None
        if isinstance(stop, list):
            stop_strings = [s for s in stop if isinstance(s, str)]
            if not stop_strings:
                stop_tokens = [s for s in stop if isinstance(s, int)]
        result = self._model.sample(
            prompt,
            request.num_samples,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop_token_ids=stop_tokens,
            stop_strings=stop_strings,
            prompt_logprobs=bool(request.prompt_logprobs),
            weights=self._sampler_weights(request.sampling_session_id),
        )
        sequences: list[tuple[list[int], list[float], str]] = [
            (s.tokens, s.logprobs, s.stop_reason) for s in result.sequences
        ]
        return encode_sample_response(sequences, result.prompt_logprobs), "proto"
