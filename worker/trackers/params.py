"""A job's resolved spec as flat tracker params: ``{"grpo.kl.beta": "0.04", ...}``.

Nested sections join with ``.``, list items by index (``graders.0.type``). Inline dataset rows
are summarised by their count (a spec may hold 100,000 of them), the ``integrations`` section
is left out (it says where the params go, not how the model was trained), keys are confined
to the characters MLflow accepts and cut at 250 characters, values at 6000, and the number of
params is bounded.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_KEY_CHARS = 250
MAX_VALUE_CHARS = 6000
MAX_PARAMS = 1000
_KEY_CHARS = re.compile(r"[^\w./\- ]")
_SKIPPED = {"integrations"}


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def flatten_spec(spec: dict[str, Any]) -> dict[str, str]:
    """The stored (resolved) spec as at most MAX_PARAMS flat params, in spec order."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if len(out) >= MAX_PARAMS:
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, list) and node:
            for i, value in enumerate(node):
                walk(value, f"{prefix}.{i}")
        else:
            key = _KEY_CHARS.sub("_", prefix)[:MAX_KEY_CHARS]
            out[key] = _value(node)

    for section, value in spec.items():
        if section in _SKIPPED:
            continue
        if section == "dataset" and isinstance(value, dict) and value.get("rows"):
            value = {**value, "rows": f"{len(value['rows'])} rows"}
        walk(value, section)
    return out
