"""``grpo train recipe.yaml``: run the trainer on this machine, no service needed.

Progress goes to stderr: a bar on a terminal, else (or with ``--no-progress``) one line per
step (step, reward, loss, an async run's staleness). Every step's metrics are also written to
``metrics.jsonl`` in the output folder, one JSON object a line
(``trainer.run.callbacks.MetricsFile``).

Exit codes: 0 done (or stopped with a checkpoint after Ctrl-C), 1 the run failed (the trainer's
reason code is printed), 2 the recipe or the arguments are invalid.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, get_args

import yaml
from pydantic import ValidationError

from jobspec import JobSpec, RolloutEngineName

if TYPE_CHECKING:
    from trainer.run.callbacks import Callbacks
    from trainer.run.loop import TrainResult

__all__ = ["build_parser", "load_recipe", "main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class RecipeError(Exception):
    """The recipe cannot be used; the message says why (field paths included)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo train",
        description="Fine-tune a model with GRPO from a recipe (a YAML job spec).",
    )
    parser.add_argument("recipe", type=Path, help="YAML file holding a job spec")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where checkpoints go (default: runs/<recipe name>)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="PATH|latest",
        help="resume from a checkpoint folder, or from the newest one in the output dir",
    )
    parser.add_argument("--steps", type=int, default=None, help="override grpo.steps")
    parser.add_argument(
        "--engine",
        choices=get_args(RolloutEngineName),  # the spec's names, so the two cannot disagree
        default=None,
        help="override rollout.engine",
    )
    parser.add_argument("--device", default="cpu", help="torch device of the trainer (cpu, cuda)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice). 1 is much faster for the tiny "
        "model, and on a machine whose cores are busy with other work",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks (devices) to train on, started through torchrun; rank 0 reports here and "
        "Ctrl-C reaches it as a stop request. Sets the recipe's resources.devices (default: "
        "the recipe's, 1 unless it says: in this process)",
    )
    parser.add_argument(
        "--async",
        dest="max_staleness",
        type=int,
        default=None,
        metavar="K",
        help="override grpo.async.max_staleness: roll out up to K steps ahead of the update in "
        "a rollout server (0: the synchronous step)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar: one line per step instead (as when stderr is not a terminal)",
    )
    return parser


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(recipe)"
        lines.append(f"  {path}: {err['msg']}")
    return "\n".join(lines)


def load_recipe(
    path: Path,
    *,
    steps: int | None = None,
    engine: str | None = None,
    devices: int | None = None,
    max_staleness: int | None = None,
) -> JobSpec:
    """Read and validate a recipe, applying command-line overrides before validation."""
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RecipeError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a mapping (a job spec), not {type(data).__name__}")
    if steps is not None or max_staleness is not None:
        grpo = data.setdefault("grpo", {})
        if not isinstance(grpo, dict):
            raise RecipeError("grpo: must be a mapping")
        if steps is not None:
            grpo["steps"] = steps
        if max_staleness is not None:
            section = grpo.get("async") or {}
            if not isinstance(section, dict):
                raise RecipeError("grpo.async: must be a mapping")
            grpo["async"] = {**section, "max_staleness": max_staleness}
    if engine is not None:
        rollout = data.setdefault("rollout", {})
        if not isinstance(rollout, dict):
            raise RecipeError("rollout: must be a mapping")
        rollout["engine"] = engine
    if devices is not None:
        data["resources"] = {**(data.get("resources") or {}), "devices": devices}
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{path} is not a valid job spec:\n{_format_errors(exc)}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.nproc is not None and args.nproc < 1:
        print("error: --nproc must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = load_recipe(
            args.recipe,
            steps=args.steps,
            engine=args.engine,
            devices=args.nproc,
            max_staleness=args.max_staleness,
        )
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if config.dataset.file_id is not None:
        print(
            "error: dataset.file_id refers to a file uploaded to the service; "
            "put the rows inline (dataset.rows) to train from the command line",
            file=sys.stderr,
        )
        return EXIT_USAGE
    for warning in config.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    output_dir: Path = args.output_dir or Path("runs") / (config.name or args.recipe.stem)

    if args.threads is not None and args.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads is not None:
        # Before torch (and vLLM, which binds its OpenMP threads at start) are imported.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # torch and the models load only now, so argument errors come back instantly.
    import torch

    from trainer.checkpoint.store import latest_checkpoint
    from trainer.errors import TrainerError
    from trainer.run.callbacks import CallbackList, ConsoleCallbacks, MetricsFile

    resume: Path | None = None
    if args.resume == "latest":
        resume = latest_checkpoint(output_dir)
        if resume is None:
            print(f"no checkpoint in {output_dir}; starting from scratch", file=sys.stderr)
    elif args.resume is not None:
        resume = Path(args.resume)
        if not (resume / "manifest.json").is_file():
            print(f"error: {resume} is not a checkpoint folder", file=sys.stderr)
            return EXIT_USAGE

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # in case torch was imported before main()
    console = ConsoleCallbacks(disable=args.no_progress)
    # Every step's metrics, one JSON object a line, in the output folder (metrics.jsonl).
    callbacks = CallbackList(console, MetricsFile())

    def _on_sigint(signum: int, frame: FrameType | None) -> None:
        # First Ctrl-C: finish the step and save; a second one interrupts at once.
        console.request_stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\nstopping after this step (Ctrl-C again to abort)", file=sys.stderr)

    # Signal handlers can only be installed from the main thread.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if in_main else None
    try:
        result = _run(config, callbacks, config.resources.devices, output_dir, resume, args.device)
    except TrainerError as exc:
        print(f"error: training failed ({exc.reason}): {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        console.close()
        if in_main:
            signal.signal(signal.SIGINT, previous)
    state = "stopped early at" if result.stopped_early else "finished"
    print(f"{state} step {result.final_step}; checkpoint: {result.checkpoint_path}")
    return EXIT_OK


def _run(
    config: JobSpec,
    callbacks: Callbacks,
    nproc: int,
    output_dir: Path,
    resume: Path | None,
    device: str,
) -> TrainResult:
    """The run: in this process for one rank, else ``nproc`` ranks under torchrun whose output
    (the ranks' own logs, torchrun's report) is printed above the progress bar."""
    if nproc == 1:
        from trainer.run.loop import train

        return train(config, callbacks, output_dir=output_dir, resume_from=resume, device=device)
    from trainer.run.launch import launch_ranks

    launch_log = logging.getLogger("trainer.run.launch")
    handler = _TqdmHandler()
    launch_log.addHandler(handler)
    launch_log.setLevel(logging.INFO)
    try:
        return launch_ranks(
            config, callbacks, nproc=nproc, output_dir=output_dir, resume_from=resume, device=device
        )
    finally:
        launch_log.removeHandler(handler)


class _TqdmHandler(logging.Handler):
    """Log lines written above the progress bar rather than through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
