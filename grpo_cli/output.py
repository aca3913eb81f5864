"""Where a client command writes: human text or one JSON document on stdout, errors on stderr
(and, with --json, as a JSON document on stdout too). Shared by `grpo_cli.ci`'s commands and
`grpo download` (`grpo_cli.download`)."""

from __future__ import annotations

import json
import sys

from grpo_cli.ci_args import Exit


class Output:
    def __init__(self, as_json: bool) -> None:
        self.json = as_json

    def text(self, line: str = "") -> None:
        if not self.json:
            print(line, flush=True)

    def doc(self, body: object) -> None:
        print(json.dumps(body, indent=2, default=str), flush=True)

    def error(self, message: str, code: Exit) -> int:
        if self.json:
            self.doc({"error": message, "exit_code": int(code)})
        print(f"error: {message}", file=sys.stderr, flush=True)
        return int(code)
