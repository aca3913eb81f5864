"""What a vLLM server's Prometheus page (``GET /metrics``) says about its load: the requests it
is running and waiting on, and the LoRA adapters those requests use. Eviction reads it (an
engine or adapter in use is never evicted), and so do the tests of a client's disconnect."""

from __future__ import annotations

import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
LORA_INFO = "vllm:lora_requests_info"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    adapters_in_use: frozenset[str]  # served names of adapters with running or waiting requests

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group("name") != name:
            continue
        labels = dict(_LABEL.findall(match.group("labels") or ""))
        try:
            found.append((labels, float(match.group("value"))))
        except ValueError:
            continue
    return found


def parse_load(text: str) -> EngineLoad:
    """The load in a /metrics page. Counters are summed over label sets (one per model name);
    the LoRA info gauge keeps one series per label combination ever seen, its value the time it
    was set, so the newest series tells the adapters in use now."""
    running = sum(value for _, value in _samples(text, RUNNING))
    waiting = sum(value for _, value in _samples(text, WAITING))
    in_use: frozenset[str] = frozenset()
    lora = _samples(text, LORA_INFO)
    if lora:
        labels, _ = max(lora, key=lambda sample: sample[1])
        names = (
            f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
        )
        in_use = frozenset(n.strip() for n in names.split(",") if n.strip())
    return EngineLoad(int(running), int(waiting), in_use)
