"""Arguments of the client commands (`grpo submit`, `jobs`, `logs`, `metrics`, `download`) and their exit
codes. Only argparse here: `grpo` builds its whole parser for every command, and the client code
itself (grpo_cli.ci) is imported only when one of these commands runs."""

from __future__ import annotations

import argparse
import json
from enum import IntEnum

from grpo_cli.gates import Requirement, parse_duration, parse_requirement

# The job statuses the API filters on (app.core.job_status.JobStatus). A copy, because the client
# imports nothing of the service; tests/cli/test_usage.py checks that the two agree.
JOB_STATUSES = (
    "queued",
    "running",
    "pausing",
    "paused",
    "cancelling",
    "succeeded",
    "failed",
    "cancelled",
)


# The webhook events `submit --webhook` subscribes to (app.webhooks.protocol.EVENT_TYPES; a copy, like
# JOB_STATUSES, checked by tests/cli/test_submit_webhook.py).
WEBHOOK_EVENTS = ("job.running", "job.succeeded", "job.failed", "job.cancelled", "job.checkpoint")


class Exit(IntEnum):
    """Exit codes of the client commands; docs/ci.md has the same table."""

    OK = 0  # done; for `submit --wait`: the job succeeded and met every --require
    INTERNAL = 1  # an unexpected error (a bug): a traceback is printed
    USAGE = 2  # bad arguments or spec file, no key, or the API refused the request (4xx)
    JOB_FAILED = 3  # the job ended failed or cancelled
    REQUIREMENT_NOT_MET = 4  # the job succeeded, but a --require did not hold
    TIMED_OUT = 5  # --timeout passed before the job ended
    UNAVAILABLE = 6  # the API could not be reached, or answered 5xx / 409 (retry later)


EXIT_CODES_HELP = """\
exit codes:
  0  succeeded, and every --require holds
  1  unexpected error (a bug; a traceback is printed)
  2  usage error: bad arguments, unreadable spec, no API key, or the API refused
     the request (401 bad key, 404 no such job, 422 invalid spec)
  3  the job failed or was cancelled
  4  the job succeeded but a --require did not hold
  5  --timeout passed before the job finished (the job keeps running unless
     --cancel-on-timeout)
  6  the API could not be reached or was unavailable (connection error, 5xx, 409);
     retrying is safe: the idempotency key returns the same job
"""

SUBMIT_EPILOG = (
    EXIT_CODES_HELP
    + """
requirements are checked on the job's final metrics: for each metric, the value
recorded at the last step that has it (eval/* metrics: the last evaluation).
A metric the job never recorded fails its requirement.
"""
)

SUBMIT_DESCRIPTION = """\
Submit a job spec (YAML or JSON; - for stdin), optionally wait for it to end and
gate on its final metrics.

Retrying is safe: the Idempotency-Key defaults to a hash of the spec and the
commit being built ($GITHUB_SHA, $CI_COMMIT_SHA, or `git rev-parse HEAD` in the
spec's folder), so a re-run of the same pipeline gets the job it already started
instead of starting a second one.
"""

CI_COMMANDS = ("submit", "jobs", "logs", "metrics", "download", "chat")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _requirement(text: str) -> Requirement:
    try:
        return parse_requirement(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _setting(text: str) -> tuple[str, int | float]:
    """`grpo jobs resume --set FIELD=NUMBER`: the field and its number (an int when written as
    one)."""
    field, sep, value = text.partition("=")
    if not sep or not field.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=NUMBER")
    try:
        number = json.loads(value)
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number")
    return field.strip(), number


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection and output")
    group.add_argument(
        "--api-url",
        default=None,
        help="API address (default: $GRPO_API_URL, else http://127.0.0.1:8000).",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="API key (default: $GRPO_API_KEY, else the file $GRPO_DATA_DIR/api-key "
        "that `grpo serve` writes, by default .grpo/api-key).",
    )
    group.add_argument(
        "--retry-for",
        type=_duration,
        default=60.0,
        metavar="DURATION",
        help="Keep retrying while the API is unreachable or answers 5xx/409 for up to DURATION "
        "(default 1m), then exit 6. Covers single requests, --wait and logs --follow.",
    )
    group.add_argument("--json", action="store_true", help="Machine-readable JSON on stdout.")
    return common


def _add_submit(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`grpo submit`: a job spec, optionally waited for and gated on its final metrics."""
    raw = argparse.RawDescriptionHelpFormatter
    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="Submit a job spec; optionally wait for it and gate on its metrics.",
        description=SUBMIT_DESCRIPTION,
        epilog=SUBMIT_EPILOG,
        formatter_class=raw,
    )
    submit.add_argument("spec", help="Job spec file (YAML or JSON), or - for stdin.")
    submit.add_argument(
        "--wait",
        action="store_true",
        help="Wait until the job ends (implied by --timeout and --require).",
    )
    submit.add_argument(
        "--timeout",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="Give up waiting after DURATION (90s, 30m, 2h, 1h30m), counted from the start of "
        "the command; exit 5.",
    )
    submit.add_argument(
        "--require",
        type=_requirement,
        action="append",
        default=[],
        metavar="REQUIREMENT",
        help="A gate on a final metric, e.g. 'reward/mean>=0.6' or 'eval/accuracy>0.5' "
        "(operators >=, <=, ==, >, <). Repeatable; all must hold, else exit 4.",
    )
    key = submit.add_mutually_exclusive_group()
    key.add_argument(
        "--idempotency-key",
        default=None,
        help="Override the default key (a hash of the spec and the CI commit).",
    )
    key.add_argument(
        "--no-idempotency-key",
        action="store_true",
        help="Send no key: always create a new job.",
    )
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate the spec and print its memory plan per device; create nothing. Exit 0 "
        "when it fits the workers' devices, 2 when it does not.",
    )
    submit.add_argument(
        "--cancel-on-timeout",
        action="store_true",
        help="Cancel the job when --timeout passes (it keeps running otherwise).",
    )
    submit.add_argument(
        "--poll-interval",
        type=_duration,
        default=2.0,
        metavar="DURATION",
        help="How often to check the job while waiting (default 2s).",
    )
    submit.add_argument(
        "--no-progress", action="store_true", help="No progress bar on stderr while waiting."
    )
    submit.add_argument(
        "--webhook",
        default=None,
        metavar="URL",
        help="Make sure the project has a webhook endpoint at URL (every job event, for every "
        "job of the project, until deleted) before submitting; a new endpoint's signing secret "
        "is printed once.",
    )


def _add_jobs(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`grpo jobs list|show|cancel|pause|resume [--set FIELD=NUMBER ...]`."""
    jobs = sub.add_parser("jobs", help="List, show, cancel, pause and resume jobs.")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    listing = jobs_sub.add_parser("list", parents=[common], help="List jobs, newest first.")
    listing.add_argument(
        "--status",
        action="append",
        default=[],
        choices=JOB_STATUSES,
        help="Only jobs in this status (repeatable).",
    )
    listing.add_argument("--limit", type=int, default=20, help="At most this many (1-100).")
    listing.add_argument("--after", default=None, help="Cursor: the last job id of a page.")
    show = jobs_sub.add_parser("show", parents=[common], help="One job in detail.")
    show.add_argument("job_id")
    cancel = jobs_sub.add_parser(
        "cancel", parents=[common], help="Cancel a job (a no-op when it already ended)."
    )
    cancel.add_argument("job_id")
    pause = jobs_sub.add_parser(
        "pause", parents=[common], help="Pause a job: it checkpoints and gives its worker back."
    )
    pause.add_argument("job_id")
    resume = jobs_sub.add_parser(
        "resume",
        parents=[common],
        help="Resume a paused or failed job from its last checkpoint, optionally with changed settings.",
        description="Resume a paused or failed job from its last checkpoint. With --set, the job resumes "
        "with those settings changed, e.g. after the mismatch guard paused it: --set "
        "grpo.learning_rate=1e-5 --set grpo.async.max_staleness=1. A job may change "
        "grpo.learning_rate, grpo.steps, grpo.async.max_staleness, grpo.async.max_mismatch "
        "and grpo.async.max_capped_frac; the API refuses any other field, naming it (exit 2).",
    )
    resume.add_argument("job_id")
    resume.add_argument(
        "--set",
        dest="settings",
        type=_setting,
        action="append",
        default=[],
        metavar="FIELD=NUMBER",
        help="A spec field (dotted) and its new value (repeatable).",
    )


def _add_logs(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`grpo logs`: a job's events and per-step metrics, optionally followed."""
    raw = argparse.RawDescriptionHelpFormatter
    logs = sub.add_parser(
        "logs",
        parents=[common],
        help="A job's events and per-step metrics.",
        description="Print a job's events and per-step metrics so far. With --follow, keep\n"
        "streaming until the job ends; a dropped connection is resumed where it stopped\n"
        "(Last-Event-ID), so every message is printed exactly once.",
        epilog="exit codes:\n"
        "  0  done (with --follow: the job succeeded)\n"
        "  2  usage error, or the API refused the request (401, 404)\n"
        "  3  with --follow: the job failed or was cancelled\n"
        "  6  the API could not be reached or was unavailable",
        formatter_class=raw,
    )
    logs.add_argument("job_id")
    logs.add_argument("-f", "--follow", action="store_true", help="Stream until the job ends.")


def _add_metrics(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`grpo metrics`: a job's per-step metrics as a table, CSV or JSON."""
    metrics = sub.add_parser(
        "metrics",
        parents=[common],
        help="A job's per-step metrics as a table, CSV or JSON.",
    )
    metrics.add_argument("job_id")
    metrics.add_argument(
        "--csv", action="store_true", help="CSV on stdout: one row per step, one column per metric."
    )
    metrics.add_argument(
        "--name",
        dest="names",
        action="append",
        default=[],
        help="Only this metric (repeatable); default: all.",
    )
    metrics.add_argument(
        "--max-points",
        type=int,
        default=None,
        help="Downsample each series to at most this many buckets (bucket means).",
    )


def _add_download(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """`grpo download`: a job's checkpoint saved as a model folder."""
    raw = argparse.RawDescriptionHelpFormatter
    download = sub.add_parser(
        "download",
        parents=[common],
        help="Save a job's checkpoint (model or LoRA adapters, and tokenizer) to a folder.",
        description="Download a checkpoint of a job as a model folder: a Hugging Face model\n"
        "folder, or for a LoRA job its adapter folder (with --merge: the base with the\n"
        "adapters merged in, which needs torch and peft). The trainer's resume state\n"
        "(optimizer, RNG states) is not included. The folder appears complete or not at all.",
        epilog="exit codes:\n"
        "  0  saved\n"
        "  2  usage error, --out exists, --merge without torch/peft or a failed merge, or the\n"
        "     API refused the request (401; 404 no such job or step; 410 checkpoint deleted)\n"
        "  6  the API could not be reached or was unavailable (the download is retried for\n"
        "     --retry-for)",
        formatter_class=raw,
    )
    download.add_argument(
        "job_id",
        help="A job id, or a fine-tuned model or checkpoint name of the OpenAI-compatible API "
        "(ft:<model>:<suffix>:<job id>[:ckpt-step-<N>]).",
    )
    download.add_argument(
        "--step", type=int, default=None, help="The checkpoint's step (default: the latest)."
    )
    download.add_argument(
        "--out", default=None, help="The folder to create (default: ./<job_id>-step<N>)."
    )
    download.add_argument(
        "--merge",
        action="store_true",
        help="For a LoRA checkpoint: save its base with the adapters merged in (needs torch).",
    )
    download.add_argument("--no-progress", action="store_true", help="No progress bar on stderr.")


CHAT_RETRY_FOR_S = 300.0  # a cold engine of a fine-tuned model starts in tens of seconds
CHAT_DESCRIPTION = """\
Chat with a model through the API's OpenAI-compatible /v1/chat/completions; the
reply is streamed as it is generated. With PROMPT: one question, one answer.
Without: one turn per line of stdin (each reply joins the conversation).

A model whose engine is still starting answers 503 with Retry-After: the command
waits that long and asks again, for up to --retry-for (default 5m here).
"""


def _add_chat(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    chat = sub.add_parser(
        "chat",
        parents=[common],
        help="Chat with a base or fine-tuned model; the reply is streamed.",
        description=CHAT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("model", help="ft:..., ft:...:ckpt-step-N, job_...[@N] or a base model.")
    chat.add_argument("prompt", nargs="?", help="One question (default: one per line of stdin).")
    chat.add_argument("--system", default=None, help="A system message before the first turn.")
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.set_defaults(retry_for=CHAT_RETRY_FOR_S)


def add_ci_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The CI commands, each with the connection options (--api-url, --api-key, ...)."""
    common = _connection_options()
    for add in (_add_submit, _add_jobs, _add_logs, _add_metrics, _add_download, _add_chat):
        add(sub, common)
