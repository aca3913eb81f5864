"""The entry point of one rank, as torchrun's agent starts it for
:func:`trainer.run.launch.launch_ranks`:
``python -m trainer.run.rank_main --spec FILE --output-dir DIR ...``.

It owns a rank's life around the training loop: the rank dies with its agent
(``PR_SET_PDEATHSIG``), writes its pid to ``<output dir>/ranks/<rank>.pid``, and runs
``trainer.run.loop.train``. Rank 0 reports through the launcher's channel
(:mod:`trainer.run.relay`), ending with the run's result or error; the other ranks
report to no one. The exit status is 0 when the run returned, 1 when it raised.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from jobspec import JobSpec
from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks
from trainer.run.relay import Failed, Finished, RelayCallbacks, connect_from_env

__all__ = ["main", "pid_file", "set_parent_death_signal"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
AGENT_NAMES = (b"torch.distributed.run", b"torchrun")  # how the agent shows in its cmdline


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread that started it exits
    (Linux; elsewhere nothing). A rank whose agent was killed would otherwise train on alone,
    holding its devices."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _agent_alive() -> bool:
    """Whether this rank's parent is still torchrun's agent. The agent may die between starting
    the rank and the prctl call above; the rank is then an orphan no signal will reach."""
    try:
        cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return not sys.platform.startswith("linux")  # no /proc: nothing to check
    return any(name in cmdline for name in AGENT_NAMES)


def pid_file(output_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a run writing to ``output_dir`` records its pid."""
    return Path(output_dir) / "ranks" / f"{rank}.pid"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.run.rank_main")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec as JSON")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sample-groups", type=int, required=True)
    parser.add_argument("--applies-retention", action="store_true")
    parser.add_argument("--answer-timeout", type=float, required=True)
    return parser


def _write_pid(output_dir: Path, rank: int) -> None:
    path = pid_file(output_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(path)  # a reader never sees a half-written pid


def main(argv: Sequence[str] | None = None) -> int:
    set_parent_death_signal()
    # A crash in native code (a rank once died of SIGSEGV in a gloo gather under load) prints
    # every thread's Python stack into the agent's output, which the launcher logs.
    faulthandler.enable()
    if not _agent_alive():
        print("rank: the agent that started this rank is gone; exiting", file=sys.stderr)
        return 1
    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    _write_pid(args.output_dir, rank)
    spec = JobSpec.model_validate_json(args.spec.read_text(encoding="utf-8"))
    relay = None
    callbacks = Callbacks()
    if rank == 0:
        relay = RelayCallbacks(
            connect_from_env(),
            applies_retention=args.applies_retention,
            answer_timeout_s=args.answer_timeout,
        )
        callbacks = relay
    from trainer.run.loop import train  # torch: only once the rank's setup is done

    try:
        result = train(
            spec,
            callbacks,
            output_dir=args.output_dir,  # only rank 0 writes (trainer.run.checkpoints)
            resume_from=args.resume_from,
            device=args.device,
            sample_groups=args.sample_groups,
        )
    except Exception as exc:
        traceback.print_exc()  # into the agent's output, which the launcher logs
        if relay is not None:
            reason = exc.reason if isinstance(exc, TrainerError) else None
            relay.finish(Failed(reason, str(exc)[:4000], type(exc).__name__))
        return 1
    if relay is not None:
        relay.finish(
            Finished(
                result.final_step, result.last_metrics, result.checkpoint_path, result.stopped_early
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
