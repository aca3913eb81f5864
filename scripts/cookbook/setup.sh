#!/usr/bin/env bash
# Create .venv-cookbook: tinker-cookbook's rl_loop and sl_loop, pinned, in a venv of their own,
# to run against `grpo serve` (docs/tinker-cookbook.md). Safe to re-run: the marker file names the
# pins that passed the checks, so a re-run does nothing and a new pin reinstalls.
#
# Why not `pip install tinker-cookbook==0.6.1`: it requires `tml-renderers>=0.4.1`, which the
# registry does not have (its newest is 0.2.1). tml-renderers is only imported for the
# thinkingmachines/Inkling and Kimi-K3 models, never by rl_loop or sl_loop, so the cookbook is
# installed with --no-deps and its other requirements (its METADATA's Requires-Dist, less
# tml-renderers, plus the math-rl extra that rl_loop's grader imports) are listed here.
#
# torch: the cookbook imports it (tensors for the loss inputs). The pin is the main venv's
# (scripts/setup.sh): 2.13.0, the CPU build where a local wheel or a CPU index provides it.
# Set COOKBOOK_TORCH_INDEX (e.g. the PyTorch CPU wheel index) to fetch the CPU build from there
# instead of the registry's default build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${COOKBOOK_VENV:-.venv-cookbook}
COOKBOOK=0.6.1
TINKER_SDK=0.38.0
TORCH=2.13.0
# The cookbook's runtime requirements (tinker-cookbook 0.6.1 METADATA), at versions that
# resolved together and ran both loops (docs/tinker-cookbook.md).
DEPS=(
    "aiohttp==3.14.5" "anyio==4.16.0" "blobfile==3.3.0" "chz==0.4.0" "cloudpickle==3.1.3"
    "datasets==5.2.0" "huggingface-hub==2.4.0" "numpy==2.4.6" "pillow==13.0.0"
    "pydantic==2.14.4" "pyrage==1.4.0" "rich==15.0.0" "safetensors==0.8.0"
    "termcolor==3.3.0" "tiktoken==0.14.0" "tqdm==4.70.1" "transformers==5.24.0"
    # the math-rl extra: rl_loop grades GSM8K answers with recipes/math_rl/math_grading
    "sympy==1.14.0" "pylatexenc==2.11" "math-verify==0.9.0"
)
MARKER="$VENV/.cookbook-$COOKBOOK-tinker-$TINKER_SDK-torch-$TORCH"
if [ -e "$MARKER" ]; then
    echo "setup: $VENV is ready (tinker-cookbook $COOKBOOK, tinker $TINKER_SDK, torch $TORCH)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install --quiet --upgrade pip wheel
if [ -n "${COOKBOOK_TORCH_INDEX:-}" ]; then
    "$PIP" install --quiet "torch==$TORCH" --index-url "$COOKBOOK_TORCH_INDEX"
else
    "$PIP" install --quiet "torch==$TORCH"
fi
"$PIP" install --quiet "tinker==$TINKER_SDK" "torch==$TORCH" "${DEPS[@]}"
"$PIP" install --quiet --no-deps "tinker-cookbook==$COOKBOOK"
# Nothing here needs them, and a CUDA build of one breaks CPU torch.
"$PIP" uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - "$COOKBOOK" "$TINKER_SDK" <<'PY'
import sys

import tinker
import tinker_cookbook
import torch
from tinker_cookbook.recipes import rl_loop, sl_loop  # noqa: F401  (their imports resolve)

cookbook, sdk = sys.argv[1:]
assert tinker_cookbook.__version__ == cookbook, tinker_cookbook.__version__
assert tinker.__version__ == sdk, tinker.__version__
print(f"setup ok: tinker-cookbook {cookbook}, tinker {sdk}, torch {torch.__version__}")
PY
touch "$MARKER"
