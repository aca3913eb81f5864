"""Whether an engine's model can write JSON, before a `response_format` request is forwarded.

vLLM enforces `json_object` and `json_schema` by masking every token the grammar forbids. A
model whose vocabulary cannot spell JSON (the packaged tiny model's character-level vocabulary
has no `{` or `"`) has nothing left to sample: the engine samples a masked token, rejects it
("grammar rejected tokens") and answers 500, which the gateway passed on as a 502 for every
such request. The engine itself survives; structured outputs work on CPU with a
model that can write JSON (SmolLM2's BPE vocabulary, tests/app/gateway/test_inference_gateway.py).

So the gateway asks the engine once per served model, through vLLM's own `/tokenize` and
`/detokenize`, whether a small JSON text survives the round trip, and refuses a request for a
model that cannot write it with a 400 naming `response_format`. The answer is cached per engine
and model for `CACHE_S`; a probe the engine does not answer decides nothing (the request goes
on, and the engine answers what it answers).
"""

from __future__ import annotations

import logging
import time

import httpx

from app.gateway.request_parts import UnsupportedParameter

log = logging.getLogger(__name__)

PROBE = '{"a": [1, "b"], "c": null}'
CACHE_S = 600.0
MAX_CACHED = 1024
PROBE_TIMEOUT_S = 5.0

_known: dict[tuple[str, str], tuple[bool, float]] = {}  # (engine, model) -> (writes JSON, until)


async def _round_trip(
    client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]
) -> bool | None:
    """Whether PROBE tokenizes and detokenizes to itself; None when the engine did not say."""
    root = base_url.rstrip("/")
    try:
        tokens = await client.post(
            f"{root}/tokenize",
            json={"model": model, "prompt": PROBE, "add_special_tokens": False},
            headers=headers,
            timeout=PROBE_TIMEOUT_S,
        )
        if tokens.status_code != 200:
            return None
        text = await client.post(
            f"{root}/detokenize",
            json={"model": model, "tokens": tokens.json()["tokens"]},
            headers=headers,
            timeout=PROBE_TIMEOUT_S,
        )
        if text.status_code != 200:
            return None
        return bool(text.json()["prompt"] == PROBE)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.warning("could not ask the engine at %s whether it writes JSON: %r", root, exc)
        return None


async def require_json(
    client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]
) -> None:
    """UnsupportedParameter (400, param `response_format`) when the model cannot write JSON."""
    now = time.monotonic()
    key = (base_url, model)
    cached = _known.get(key)
    writes = cached[0] if cached is not None and cached[1] > now else None
    if writes is None:
        writes = await _round_trip(client, base_url, model, headers)
        if writes is None:
            return
        if len(_known) >= MAX_CACHED:
            _known.clear()  # rare (engines x models); the next probes refill it
        _known[key] = (writes, now + CACHE_S)
    if not writes:
        raise UnsupportedParameter(
            "this model's vocabulary cannot write JSON (its tokens do not spell "
            f"{PROBE!r}), so its answers cannot be constrained to JSON; ask without "
            "response_format",
            param="response_format",
        )
