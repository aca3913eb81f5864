"""`grpo download JOB [--step N] [--out DIR] [--merge]`: save a checkpoint's model locally.

The API streams the checkpoint as a tar archive with one top folder (`<job>-step<N>/`); it is
written to a temporary file beside `--out`, extracted safely (tarfile's "data" filter, and every
member must lie under that one folder) into a temporary folder, then renamed to `--out`, so
`--out` is complete or absent. `--merge` merges a LoRA checkpoint's adapters into its base with
`trainer.checkpoint.export.merge_adapter_folder`, which needs torch and peft (imported only then)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from grpo_cli.ci_args import Exit
from grpo_cli.ci_env import UsageError
from grpo_cli.client import Client
from grpo_cli.output import Output
from grpo_cli.waiting import retrying

ADAPTER_CONFIG = "adapter_config.json"


def latest_step(client: Client, job_id: str, retry_for: float) -> int:
    checkpoints = retrying(retry_for, lambda: client.checkpoints(job_id))
    if not checkpoints:
        raise UsageError(f"job {job_id} has no checkpoints yet")
    return max(int(c["step"]) for c in checkpoints)


def _merge_unavailable() -> str | None:
    missing = [name for name in ("torch", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"--merge needs {' and '.join(missing)} (install grpo-service with the cpu or gpu "
            "extra), or download without --merge and merge later"
        )
    return None


def _progress(show: bool) -> tuple[Callable[[int, int | None], None] | None, Callable[[], None]]:
    if not show:
        return None, lambda: None
    bar: tqdm[None] | None = None

    def update(done: int, total: int | None) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def extract(archive: Path, into: Path) -> Path:
    """Extract `archive` (one top folder) into the empty folder `into`; returns the top folder.
    Refuses absolute names, `..`, links and anything not under a single top folder."""
    with tarfile.open(archive) as tar:
        infos = tar.getmembers()
        tops = {PurePosixPath(info.name).parts[0] for info in infos if info.name}
        if len(tops) != 1:
            raise ValueError("the archive is not one folder")
        top = tops.pop()
        for info in infos:
            parts = PurePosixPath(info.name).parts
            if info.name.startswith("/") or ".." in parts or top in ("", ".", ".."):
                raise ValueError(f"unsafe name in the archive: {info.name!r}")
            if not (info.isfile() or info.isdir()):
                raise ValueError(f"the archive holds a non-file member: {info.name!r}")
        tar.extractall(into, filter="data")
    return into / top


def _save(client: Client, args: argparse.Namespace, step: int, out: Path, show: bool) -> int:
    """Download and extract to `out`; returns the archive's size."""
    out.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in finally
        prefix=f".{out.name}.", suffix=".tar", dir=out.parent, delete=False
    )
    archive = Path(handle.name)
    workdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with handle:

            def fetch() -> int:
                handle.seek(0)
                handle.truncate()
                update, close = _progress(show)
                try:
                    return client.download_checkpoint(args.job_id, step, handle, update)
                finally:
                    close()

            size = retrying(args.retry_for, fetch)
        folder = extract(archive, workdir)
        if out.exists():
            raise UsageError(f"{out} exists; choose a new folder with --out")
        os.rename(folder, out)
        return size
    finally:
        archive.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _merge(adapter: Path, out: Path) -> None:
    from trainer.checkpoint.export import merge_adapter_folder

    merge_adapter_folder(adapter, out)


# A fine-tuned model's name in the OpenAI-compatible API: ft:<model>:<suffix>:<job id>, and
# a checkpoint's: that plus :ckpt-step-<step> (app/fine_tuning/presenters.py writes them; a
# test checks the two agree).
CHECKPOINT_SUFFIX = "ckpt-step-"


def parse_model_name(name: str) -> tuple[str, int | None] | None:
    """(job id, step or None) of a fine-tuned model or checkpoint name, or None for a name
    that is not one (a plain job id)."""
    if not name.startswith("ft:"):
        return None
    parts = name.split(":")
    step = None
    if parts[-1].startswith(CHECKPOINT_SUFFIX):
        number = parts.pop().removeprefix(CHECKPOINT_SUFFIX)
        if not number.isdigit():
            raise UsageError(f"{name!r} ends in an invalid checkpoint step")
        step = int(number)
    if len(parts) < 4 or not parts[-1].startswith("job_"):
        raise UsageError(f"{name!r} is not a fine-tuned model name (ft:<model>:<suffix>:<job id>)")
    return parts[-1], step


def download(args: argparse.Namespace, out: Output, client: Client) -> int:
    named = parse_model_name(args.job_id)
    if named is not None:
        job_id, named_step = named
        if named_step is not None and args.step is not None and args.step != named_step:
            raise UsageError(f"--step {args.step} contradicts the checkpoint name's step")
        args.job_id = job_id
        args.step = args.step if named_step is None else named_step
    if args.step is not None and args.step < 0:
        raise UsageError("--step must be >= 0")
    if args.merge and (why := _merge_unavailable()):
        raise UsageError(why)
    step = args.step if args.step is not None else latest_step(client, args.job_id, args.retry_for)
    target = Path(args.out) if args.out else Path(f"{args.job_id}-step{step}")
    if target.exists():
        raise UsageError(f"{target} exists; choose a new folder with --out")
    show = not out.json and not args.no_progress and sys.stderr.isatty()
    merged = False
    if args.merge:
        # The adapters go to a temporary folder beside the target; the merged model to --out.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.adapter-", dir=target.parent))
        try:
            size = _save(client, args, step, staging / "checkpoint", show)
            if (staging / "checkpoint" / ADAPTER_CONFIG).is_file():
                out.text(f"merging the LoRA adapters of step {step} into their base model")
                try:
                    _merge(staging / "checkpoint", target)
                except (OSError, ValueError) as exc:
                    return out.error(f"merging failed: {exc}", Exit.USAGE)
                merged = True
            else:
                out.text("a full checkpoint: nothing to merge")
                os.rename(staging / "checkpoint", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    else:
        size = _save(client, args, step, target, show)
    if out.json:
        out.doc(
            {
                "job_id": args.job_id,
                "step": step,
                "path": str(target),
                "bytes": size,
                "merged": merged,
                "exit_code": int(Exit.OK),
            }
        )
    else:
        out.text(
            f"saved step {step} of job {args.job_id} to {target}" + (" (merged)" if merged else "")
        )
    return Exit.OK
