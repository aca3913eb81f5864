"""``grpo worker`` whose model writes scripted turns: run as
``python -m tests.worker.scripted_agent_worker worker`` (tests.worker.conftest.WorkerProcess
with ``module=``).

A random model never writes a well-formed tool call, so the service tests of agent jobs script
the model's turns, as the trainer's tests do (tests.agent_jobs.ScriptedEngine answering with
scripted_reply). Only jobs whose model folder is named :data:`SCRIPTED_MODEL` get the script,
in place of the transformers engine; every other job of this worker, and everything else of
these jobs (the API, the queue, the worker, the sandboxed tools and environment, the graders,
the training and what is recorded), is the real service.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SCRIPTED_MODEL = "scripted-agent-llama"


def install() -> None:
    from tests.agent_jobs import ScriptedEngine, scripted_reply
    from trainer.rollout import registry

    real = registry.ROLLOUT_ENGINES["transformers"]

    def engine(model_path: Path, tokenizer: Any, **options: Any) -> Any:
        if Path(model_path).name != SCRIPTED_MODEL:
            return real(model_path, tokenizer, **options)
        return ScriptedEngine(tokenizer, scripted_reply)

    registry.ROLLOUT_ENGINES["transformers"] = engine


if __name__ == "__main__":
    install()
    from grpo_cli.main import main

    raise SystemExit(main(sys.argv[1:]))
