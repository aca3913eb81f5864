#!/usr/bin/env bash
# Run tinker-cookbook's sl_loop and rl_loop (0.6.1, unchanged, from .venv-cookbook) against a
# running grpo-service, with configuration only: command-line fields, environment variables and
# the local folders scripts/cookbook/make_datasets.py wrote. Starts nothing else. Each loop's
# output goes to <log dir>/<loop>.out; its metrics (metrics.jsonl) are printed as a table after
# it ends. docs/tinker-cookbook.md has the steps and the results.
#
#   TINKER_API_KEY=tml-... COOKBOOK_DATA=/path/from/make_datasets scripts/cookbook/run.sh [sl|rl|both]
#
# Environment:
#   TINKER_API_KEY   a Tinker key (`grpo keys create --tinker`), required
#   TINKER_BASE_URL  the service (default http://127.0.0.1:8000)
#   COOKBOOK_DATA    the folder make_datasets.py wrote, required: the loops run in it, so the
#                    names they load (openai/gsm8k, HuggingFaceH4/no_robots, the model's
#                    tokenizer) resolve to its folders
#   COOKBOOK_MODEL   the cookbook's model name (default meta-llama/Llama-3.2-1B): it picks the
#                    renderer, names the tokenizer folder, and is the base model sent to the
#                    server, which must map it to a packaged model
#   COOKBOOK_LOGS    where the runs write (default $COOKBOOK_DATA/runs/<time>)
#   SL_ARGS, RL_ARGS more `field=value` for each loop; they come last, so they win
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${COOKBOOK_PYTHON:-$ROOT/.venv-cookbook/bin/python}
WHAT=${1:-both}
case "$WHAT" in sl | rl | both) ;; *) echo "usage: $0 [sl|rl|both]" >&2; exit 2 ;; esac
[ -x "$PY" ] || { echo "no $PY: run scripts/cookbook/setup.sh" >&2; exit 2; }
: "${TINKER_API_KEY:?set TINKER_API_KEY to a tml- key (grpo keys create --tinker)}"
: "${COOKBOOK_DATA:?set COOKBOOK_DATA to the folder scripts/cookbook/make_datasets.py wrote}"
BASE_URL=${TINKER_BASE_URL:-http://127.0.0.1:8000}
MODEL=${COOKBOOK_MODEL:-meta-llama/Llama-3.2-1B}
DATA=$(cd "$COOKBOOK_DATA" && pwd)
LOGS=${COOKBOOK_LOGS:-$DATA/runs/$(date +%Y%m%d-%H%M%S)}
for folder in openai/gsm8k HuggingFaceH4/no_robots "$MODEL"; do
    [ -d "$DATA/$folder" ] || {
        echo "no $DATA/$folder: run scripts/cookbook/make_datasets.py $DATA" \
            "(with --tokenizer $MODEL=<packaged model> for a model name of your own)" >&2
        exit 2
    }
done
mkdir -p "$LOGS"

# Offline: every name resolves to a folder under $DATA; the hub is never asked.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_CACHE="$DATA/.hf-datasets-cache"
export TOKENIZERS_PARALLELISM=false
export TINKER_API_KEY

summary() {  # the loop's metrics.jsonl as a table
    "$PY" - "$1" "$2" <<'PY'
import json
import sys
from pathlib import Path

loop, log = sys.argv[1], Path(sys.argv[2])
rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line]
if loop == "sl":
    print(f"{'step':>4}  {'train_mean_nll':>14}  {'tokens':>6}  {'lr':>8}  {'seconds':>7}")
    for r in rows:
        print(f"{r['step']:>4}  {r['train_mean_nll']:>14.4f}  {r['num_tokens']:>6}  "
              f"{r['learning_rate']:>8.2e}  {r['time_total']:>7.1f}")
else:
    print(f"{'step':>4}  {'reward':>6}  {'trained':>7}  {'seconds':>7}")
    for r in rows:
        trained = "yes" if any(k.startswith("optim/") and k != "optim/lr" for k in r) else "no"
        print(f"{r['step']:>4}  {r['reward/total']:>6.3f}  {trained:>7}  {r['time/total']:>7.1f}")
    print("(trained no: every sample of every question got the same reward, so all advantages "
          "were 0 and rl_loop skipped the update)")
PY
}

run_loop() {  # run_loop sl|rl field=value...
    local loop=$1
    shift
    local log="$LOGS/${loop}_loop"
    echo "== ${loop}_loop: $MODEL on $BASE_URL (output: $log.out)"
    local start=$SECONDS
    if ! (cd "$DATA" && "$PY" -m "tinker_cookbook.recipes.${loop}_loop" \
        base_url="$BASE_URL" model_name="$MODEL" log_path="$log" "$@") >"$log.out" 2>&1; then
        tail -n 40 "$log.out" >&2
        echo "== ${loop}_loop failed after $((SECONDS - start)) s (output: $log.out)" >&2
        return 1
    fi
    summary "$loop" "$log"
    echo "== ${loop}_loop done in $((SECONDS - start)) s; final save: $(tail -n 1 "$log/checkpoints.jsonl")"
}

# The configuration changes, each explained in docs/tinker-cookbook.md: a small model and
# batch, no intermediate saves, and for rl_loop a loss the server computes
# (importance_sampling; its default stable_reinforce needs sampler-side data Tinker does not
# document, and is refused).
# shellcheck disable=SC2086  # SL_ARGS and RL_ARGS are lists of field=value words
if [ "$WHAT" != rl ]; then
    run_loop sl batch_size=8 learning_rate=1e-2 lora_rank=8 save_every=0 ${SL_ARGS:-}
fi
# shellcheck disable=SC2086
if [ "$WHAT" != sl ]; then
    run_loop rl loss_fn=importance_sampling batch_size=4 group_size=4 max_tokens=32 max_steps=4 \
        learning_rate=1e-3 lora_rank=8 save_every=0 ${RL_ARGS:-}
fi
echo "== logs: $LOGS"
