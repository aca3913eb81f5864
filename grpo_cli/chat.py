"""`grpo chat MODEL [PROMPT]`: talk to a model the project may use (a packaged base model, one
the inference tier serves by name (GRPO_INFERENCE_BASES: a Hub id, a model folder), a fine-tuned
``ft:`` name, a checkpoint ``ft:...:ckpt-step-N``, or ``job_...[@N]``) through the API's
OpenAI-compatible ``/v1/chat/completions``, the reply streamed to the terminal as it is
generated.

With PROMPT: one question, one answer. Without: one turn per line of stdin (a conversation:
each reply joins the history). A model whose engine is still starting answers 503 with
Retry-After; the command waits that long and asks again, for up to ``--retry-for``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from grpo_cli.client import ApiError, Client
from grpo_cli.output import Output
from grpo_cli.waiting import is_transient


def chat(args: argparse.Namespace, out: Output, client: Client) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    params = {
        key: value
        for key, value in (
            ("temperature", args.temperature),
            ("max_tokens", args.max_tokens),
            ("seed", args.seed),
        )
        if value is not None
    }
    for prompt in [args.prompt] if args.prompt is not None else _stdin_turns():
        messages.append({"role": "user", "content": prompt})
        write = None if out.json else _write
        reply = stream_reply(client, args.model, messages, params, args.retry_for, write)
        if out.json:
            out.doc({"model": args.model, "reply": reply})
        else:
            _write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def stream_reply(
    client: Client,
    model: str,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    retry_for: float,
    write: Callable[[str], None] | None,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The whole reply, each piece passed to ``write`` as it arrives. Refusals before the first
    piece that are worth waiting out (503 engine starting, 429, no connection) are retried after
    the server's Retry-After, for up to ``retry_for`` seconds; a refusal after it, or a 4xx,
    is raised."""
    deadline = time.monotonic() + retry_for
    announced = False  # the first refusal is said; the retries after it are quiet
    while True:
        pieces: list[str] = []
        try:
            for piece in client.chat_stream(model, messages, **params):
                pieces.append(piece)
                if write is not None:
                    write(piece)
            return "".join(pieces)
        except (ApiError, ConnectionError) as exc:
            wait = getattr(exc, "retry_after", None) or 2.0
            if pieces or not is_transient(exc) or time.monotonic() + wait > deadline:
                raise
            if not announced:
                print(
                    f"{model}: {exc}; waiting (up to {retry_for:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                announced = True
            sleep(wait)


def _stdin_turns() -> Iterator[str]:
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
