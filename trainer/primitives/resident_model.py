"""A resident model: the LoRA model a Tinker training client trains, held in memory (its base
frozen), with its AdamW state and the gradients accumulated since the last step; the Tinker
primitives are its methods. (Not a client's session, nor a database session.)

Semantics (Tinker's): ``forward_backward`` adds the gradient of its loss, a SUM over tokens
and datums, to the accumulated gradients; ``optim_step`` applies them with that call's Adam
settings and clears them. Everything a call reads is checked before anything is computed, so a
refused call changes nothing. The model always runs in eval mode: there is no dropout to turn
on, and a training forward pass then computes exactly what sampling and scoring compute.

The resident model is not thread-safe: its owner (the service's worker) applies calls one at a
time, in order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn

from trainer.models.loading import load_policy
from trainer.primitives import sampling
from trainer.primitives.adam import AdamParams, adam_step, new_optimizer
from trainer.primitives.adapters import (
    WeightsSnapshot,
    build_lora,
    lora_targets,
    read_adapter,
    restore,
    swapped_in,
    take_snapshot,
    write_adapter,
)
from trainer.primitives.batch import micro_batches, pack
from trainer.primitives.losses import LossFunction
from trainer.primitives.resident import read_resident_extras, write_resident_extras
from trainer.primitives.scoring import target_logprobs
from trainer.primitives.state import (
    SessionSettings,
    dtype_name,
    read_optimizer,
    read_settings,
    write_atomically,
    write_state_files,
)
from trainer.primitives.types import Datum, ForwardResult, PrimitiveError, SampleResult
from trainer.primitives.validation import (
    CheckedDatum,
    Limits,
    check_data,
    resolve_config,
    resolve_loss,
)
from trainer.rollout.stop_tokens import stop_token_ids

# One resident model is built at a time in a process: transformers loads a model under a process-wide
# meta-device context, and the LoRA build seeds torch's global generator, so two threads
# building at once (a worker holding several training clients) break each other's load or
# initialisation.
_BUILDING = threading.Lock()

__all__ = ["ResidentModel"]


class ResidentModel:
    """One resident LoRA model (the base model frozen), its Adam state and accumulated
    gradients.

    Args:
        model_path: a Hugging Face model folder (``trainer.models.loading.resolve_model``).
        lora_rank: the adapters' rank (alpha is fixed, ``adapters.LORA_ALPHA``).
        seed: fixes the adapters' initialisation; None draws it.
        train_attn, train_mlp, train_unembed: which parts get adapters.
        dtype: the model's dtype (float64 for exactness tests).
        max_tokens_per_call: the most tokens one ``forward_backward`` may carry.
        micro_batch_tokens: padded tokens per forward/backward pass within a call (bounds
            activation memory; the result does not depend on it).
        base_model: the base model's name as the client knows it, recorded in adapter configs
            (default: the folder's name; never a server path).
    """

    def __init__(
        self,
        model_path: Path,
        *,
        lora_rank: int,
        seed: int | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_tokens_per_call: int = 65536,
        micro_batch_tokens: int = 8192,
        base_model: str | None = None,
    ) -> None:
        if max_tokens_per_call < 1 or micro_batch_tokens < 1:
            raise ValueError("max_tokens_per_call and micro_batch_tokens must be positive")
        self._model_path = Path(model_path)
        self._settings = SessionSettings(
            lora_rank=lora_rank,
            train_attn=train_attn,
            train_mlp=train_mlp,
            train_unembed=train_unembed,
            dtype=dtype_name(dtype),
            base_model=base_model or self._model_path.name,
        )
        self._max_tokens_per_call = max_tokens_per_call
        self._micro_batch_tokens = micro_batch_tokens
        self._device = torch.device(device)
        with _BUILDING:
            base, self._tokenizer = load_policy(self._model_path, dtype=dtype)
            module: nn.Module = base  # moved in place, before the adapters are made beside it
            module.to(self._device)
            targets = lora_targets(base, attn=train_attn, mlp=train_mlp, unembed=train_unembed)
            self.model: PeftModel = build_lora(
                base, lora_rank, targets, seed=seed, base_name=self._settings.base_model
            )
        self.model.eval()
        # Loss inputs in float32 unless the model computes in float64: the head upcasts
        # half-precision logits, so log-probabilities are never in half precision.
        self._loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self._optimizer = new_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self._steps = 0
        self._stop_ids = stop_token_ids(self._tokenizer, model=base)

    # ------------------------------------------------------------------ facts

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1`` (the embedding's rows)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        """The most tokens one sequence may have (prompt and sample together)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def tokenizer_path(self) -> Path:
        """The model folder, which holds the tokenizer files."""
        return self._model_path

    @property
    def steps(self) -> int:
        """Optimizer steps applied so far (restored by :meth:`load_state`)."""
        return self._steps

    @property
    def default_stop_token_ids(self) -> list[int]:
        """What ``stop_token_ids=None`` stops on: the eos ids the tokenizer and model declare
        and the chat template's end-of-turn token (``trainer.rollout.stop_tokens``)."""
        return list(self._stop_ids)

    # ------------------------------------------------------------------ training

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardResult:
        """The target log-probabilities of every datum and the summed loss; unless
        ``forward_only``, the loss's gradient is added to the accumulated gradients.
        PrimitiveError (before any computation) for a bad loss name, config or datum."""
        loss = resolve_loss(loss_fn)
        resolved = resolve_config(loss_fn, loss, config)
        limits = Limits(self.vocab_size, self.max_context, self._max_tokens_per_call)
        checked = check_data(data, loss, loss_fn, resolved, limits)
        lengths = [int(d.tokens.numel()) for d in checked]
        logprobs: list[list[float]] = []
        total = 0.0
        with self._all_or_no_gradient(active=not forward_only):
            for run in micro_batches(lengths, self._micro_batch_tokens):
                total += self._micro_batch(
                    [checked[i] for i in run], loss, resolved, forward_only, logprobs
                )
        return ForwardResult(logprobs, {"loss:sum": total})

    def _micro_batch(
        self,
        datums: list[CheckedDatum],
        loss: LossFunction,
        config: dict[str, float],
        forward_only: bool,
        logprobs: list[list[float]],
    ) -> float:
        """One forward (and backward) pass; appends each datum's log-probabilities to
        ``logprobs`` and returns the pass's summed loss."""
        packed = pack(datums, loss, config, self._loss_dtype, self._device)
        with torch.set_grad_enabled(not forward_only):
            lp = target_logprobs(self.model, packed.tokens, packed.targets, packed.mask)
            per_token = loss.objective(lp, packed.inputs, config)
            part = torch.where(packed.mask, per_token, torch.zeros_like(per_token)).sum()
        if not forward_only:
            part.backward()
        rows = lp.detach().cpu()
        logprobs.extend(rows[i, :n].tolist() for i, n in enumerate(packed.lengths))
        return float(part.detach())

    @contextmanager
    def _all_or_no_gradient(self, *, active: bool) -> Iterator[None]:
        """A call adds its whole gradient or none: when a pass fails midway (out of memory),
        the gradients are put back as they were before the call, so that the caller can retry
        it (smaller) without counting its first micro-batches twice."""
        if not active:
            yield
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        kept = [None if p.grad is None else p.grad.clone() for p in params]
        try:
            yield
        except BaseException:
            for param, grad in zip(params, kept, strict=True):
                param.grad = grad
            raise

    def optim_step(
        self,
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (``trainer.primitives.adam``), which
        are cleared. A non-finite gradient norm skips the step (``optim/skipped:sum`` 1)."""
        settings = AdamParams(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm)
        norm, applied = adam_step(self._optimizer, settings)
        if applied:
            self._steps += 1
        return {
            "optim/grad_norm:mean": norm,
            "optim/step:max": float(self._steps),
            "optim/skipped:sum": 0.0 if applied else 1.0,
        }

    # ------------------------------------------------------------------ weights

    def snapshot(self) -> WeightsSnapshot:
        """A copy of the trainable tensors, to sample with later while training goes on."""
        return take_snapshot(self.model)

    def load_snapshot(self, folder: Path) -> WeightsSnapshot:
        """The adapter saved in ``folder`` (by :meth:`save_adapter` or :meth:`save_state`) as
        a snapshot of this model's tensors; PrimitiveError when it does not fit."""
        return read_adapter(self.model, Path(folder))

    def save_adapter(self, folder: Path) -> None:
        """The sampler weights: a peft adapter folder (``adapter_model.safetensors``,
        ``adapter_config.json``) that vLLM or ``PeftModel.from_pretrained`` loads.
        ``folder`` must not exist; it appears complete or not at all."""
        write_atomically(Path(folder), lambda tmp: write_adapter(self.model, tmp))

    def save_state(self, folder: Path) -> None:
        """Adapter, Adam state, step count and settings (``trainer.primitives.state``), so
        that :meth:`load_state` continues exactly. ``folder`` must not exist."""

        def write(tmp: Path) -> None:
            write_adapter(self.model, tmp)
            write_state_files(tmp, self._settings, self._steps, self._optimizer.state_dict())

        write_atomically(Path(folder), write)

    @classmethod
    def load_state(
        cls,
        folder: Path,
        model_path: Path,
        *,
        optimizer: bool = True,
        device: str = "cpu",
        max_tokens_per_call: int = 65536,
        micro_batch_tokens: int = 8192,
    ) -> ResidentModel:
        """A resident model on ``model_path`` continuing the state saved in ``folder``: its adapter,
        and with ``optimizer`` its Adam state and step count (without, a fresh optimizer at
        step 0). The limits are this server's, as in the constructor. PrimitiveError when the
        folder is no state or does not fit the model."""
        folder = Path(folder)
        settings, steps = read_settings(folder)
        resident = cls(
            model_path,
            lora_rank=settings.lora_rank,
            train_attn=settings.train_attn,
            train_mlp=settings.train_mlp,
            train_unembed=settings.train_unembed,
            device=device,
            dtype=settings.torch_dtype,
            max_tokens_per_call=max_tokens_per_call,
            micro_batch_tokens=micro_batch_tokens,
            base_model=settings.base_model,
        )
        restore(resident.model, read_adapter(resident.model, folder))
        if optimizer:
            try:
                resident._optimizer.load_state_dict(read_optimizer(folder, device))
            except (ValueError, KeyError, RuntimeError) as exc:
                raise PrimitiveError(f"path: the optimizer state does not fit: {exc}") from None
            resident._steps = steps
        return resident

    def suspend(self, folder: Path, snapshots: Mapping[str, WeightsSnapshot]) -> None:
        """The whole resident model into ``folder`` (which must not exist): its state as
        :meth:`save_state` writes it, the gradients accumulated since the last step and
        ``snapshots`` (sampler weights kept in memory), so that :meth:`resume` continues
        exactly (``trainer.primitives.resident``)."""

        def write(tmp: Path) -> None:
            write_adapter(self.model, tmp)
            write_state_files(tmp, self._settings, self._steps, self._optimizer.state_dict())
            write_resident_extras(tmp, self.model, snapshots)

        write_atomically(Path(folder), write)

    @classmethod
    def resume(
        cls,
        folder: Path,
        model_path: Path,
        *,
        device: str = "cpu",
        max_tokens_per_call: int = 65536,
        micro_batch_tokens: int = 8192,
    ) -> tuple[ResidentModel, dict[str, WeightsSnapshot]]:
        """The resident model :meth:`suspend` wrote to ``folder``, with its snapshots in order."""
        resident = cls.load_state(
            folder,
            model_path,
            optimizer=True,
            device=device,
            max_tokens_per_call=max_tokens_per_call,
            micro_batch_tokens=micro_batch_tokens,
        )
        return resident, read_resident_extras(Path(folder), resident.model)

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        prompt: list[int],
        num_samples: int,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        prompt_logprobs: bool = False,
        weights: WeightsSnapshot | None = None,
    ) -> SampleResult:
        """``num_samples`` completions of ``prompt`` with ``weights`` (None: the current
        ones, which are back in place afterwards). ``stop_token_ids`` None stops on
        :attr:`default_stop_token_ids`, ``[]`` on no token. What the log-probabilities are,
        and how stops work: ``trainer.primitives.sampling``. Same seed, same samples."""
        settings = sampling.SamplingSettings(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_token_ids=frozenset(self._stop_ids if stop_token_ids is None else stop_token_ids),
            stop_strings=tuple(stop_strings),
        )
        sampling.check_sampling(
            prompt, num_samples, settings, vocab_size=self.vocab_size, max_context=self.max_context
        )
        generator = torch.Generator(device=self._device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        with swapped_in(self.model, weights):
            sequences = sampling.generate(
                self.model, self._tokenizer, prompt, num_samples, settings, generator
            )
            scored = sampling.prompt_logprobs(self.model, prompt) if prompt_logprobs else None
        return SampleResult(sequences, scored)
