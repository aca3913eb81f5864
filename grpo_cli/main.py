"""`grpo` entry point. Subcommands import what they need lazily, so `grpo keys create` never
loads torch, `grpo train` never loads the web stack, and the client commands (submit, jobs, logs,
metrics) need only httpx: they run where neither the service nor torch is installed."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from grpo_cli.ci_args import CI_COMMANDS, add_ci_commands
from grpo_cli.keys import add_keys_commands, run_keys

if TYPE_CHECKING:
    from app.core.settings import Settings


def _add_inference(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inference = sub.add_parser(
        "inference",
        help="Serve trained models: vLLM engines started on demand, behind a control API the "
        "API's gateway calls (settings: GRPO_INFERENCE_*, docs/inference.md).",
    )
    inference.add_argument("--host", default=None, help="Control API address (127.0.0.1).")
    inference.add_argument("--port", type=int, default=None, help="Control API port (8100).")
    inference.add_argument(
        "--bases",
        default=None,
        help="Base models served, separated by commas (default: the packaged models; *: any).",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO fine-tuning service.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Run the API (and an embedded worker).")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--no-worker", action="store_true", help="Do not start an embedded worker process."
    )
    serve.add_argument(
        "--no-inference",
        action="store_true",
        help="Do not start an embedded inference process (`grpo inference`).",
    )

    api = sub.add_parser(
        "api",
        help="Run the API alone, in several processes (production; migrate first with "
        "`grpo db upgrade`).",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument(
        "--workers",
        type=int,
        default=None,
        help="API processes (default: $GRPO_API_WORKERS, else 2 per core, at most 4).",
    )
    api.add_argument("--no-access-log", action="store_true", help="Do not log every request.")

    worker = sub.add_parser("worker", help="Run a worker that trains queued jobs.")
    worker.add_argument("--loglevel", default="INFO")

    _add_inference(sub)

    db = sub.add_parser("db", help="Database migrations.")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("upgrade", help="Migrate to the latest schema.")
    down = db_sub.add_parser("downgrade", help="Migrate down to a revision.")
    down.add_argument("revision", help="Target revision, e.g. -1 or base.")

    add_keys_commands(sub)

    export = sub.add_parser(
        "export",
        help="Write a checkpoint's model as a plain Hugging Face folder (LoRA: --merge).",
    )
    export.add_argument("checkpoint", help="A checkpoint folder (checkpoint-NNNNNN).")
    export.add_argument("--out", required=True, help="The folder to create.")
    export.add_argument(
        "--merge",
        action="store_true",
        help="Merge a LoRA checkpoint's adapters into its base (without: the adapters alone).",
    )
    export.add_argument(
        "--base",
        default=None,
        help="The base model folder of a LoRA checkpoint (default: the base it records).",
    )

    train = sub.add_parser("train", help="Run a recipe locally (no server).", add_help=False)
    train.add_argument("args", nargs=argparse.REMAINDER)

    add_ci_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train":
        from trainer.run.cli import main as train_main

        return train_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.command in CI_COMMANDS:
        from grpo_cli.ci import run

        return run(args)
    from app.core.settings import build_settings

    if args.command == "worker":
        from worker.main import run_worker

        run_worker(loglevel=args.loglevel)
        return 0
    if args.command == "api":
        from grpo_cli.api import resolve_workers, run_api

        try:
            workers = resolve_workers(args.workers)
        except ValueError as exc:
            print(f"grpo api: {exc}", file=sys.stderr)
            return 2
        return run_api(args.host, args.port, workers, access_log=not args.no_access_log)
    settings = build_settings()
    if args.command == "inference":
        return _inference(args, settings)
    if args.command == "serve":
        from grpo_cli.serve import serve

        return serve(
            settings,
            args.host,
            args.port,
            embedded_worker=not args.no_worker,
            embedded_inference=not args.no_inference,
        )
    if args.command == "db":
        from grpo_cli import db

        if args.db_command == "upgrade":
            db.upgrade(settings.resolved_database_url)
        else:
            db.downgrade(settings.resolved_database_url, args.revision)
        return 0
    if args.command == "keys":
        return run_keys(args, settings)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _inference(args: argparse.Namespace, settings: Settings) -> int:
    from pydantic import ValidationError

    from inference.process import run_inference
    from inference.settings import build_inference_settings

    given = {"host": args.host, "port": args.port, "bases": args.bases}
    try:
        inference = build_inference_settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        print(f"grpo inference: {exc}", file=sys.stderr)
        return 2
    return run_inference(inference, settings)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainer.checkpoint.export import export_checkpoint

    base = Path(args.base) if args.base else None
    try:
        out = export_checkpoint(Path(args.checkpoint), Path(args.out), merge=args.merge, base=base)
    except (OSError, ValueError) as exc:
        print(f"grpo export: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
