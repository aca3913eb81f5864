#!/usr/bin/env bash
# The GPU checks on a bare CUDA machine that has torch, transformers and peft but not this
# project's other dependencies (the lent H100/H200 machines: environment.md, "GPU"). The few
# pure-Python/small wheels the trainer's import path needs are carried in .whl/ (pydantic,
# pydantic-core, pydantic-settings, python-dotenv, annotated-types, typing-inspection,
# typing-extensions, google-re2), installed into /tmp/site. Then:
#   1. the GPU tier (what `make test-gpu` runs, without the venv);
#   2. a whole GRPO job on CUDA: recipes/tiny-smoke.yaml, transformers rollouts, 4 steps;
#   3. python -m bench.gpu_update (BENCHMARKS.md, "The update on a GPU"): the full and LoRA r16
#      updates with the fused and the plain output head, and the memory plan beside each peak.
# Logs and bench/results/gpu_update.json go to $OUT (default: bench/results/gpu).
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.txt"
status=0
timeout 160 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --confcutdir=tests/gpu tests/gpu \
  2>&1 | tee "$OUT/test_gpu.log" || status=1
timeout 90 python3 -c "from trainer.run.cli import main; raise SystemExit(main(['recipes/tiny-smoke.yaml', '--engine', 'transformers', '--steps', '4', '--device', 'cuda', '--output-dir', '/tmp/gpu-smoke']))" \
  > "$OUT/smoke.log" 2>&1 || status=1
tail -c 3000 "$OUT/smoke.log"
timeout 160 python3 -m bench.gpu_update --configs full,lora16 --out "$OUT/gpu_update.json" 2>&1 \
  | tee "$OUT/bench.log" || status=1
exit $status
