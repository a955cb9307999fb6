#!/bin/sh
# The shipped pass-key grid (README, "The pass-key test"): SmolLM2, five depths, into
# traces/needle/, then the report (README table, docs/needle.md). Resumable: re-run it after
# a kill. setup.py's NEEDLE lists the files this writes; change both together.
set -e
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
N=".venv/bin/python -m kvviz needle --out traces/needle --depths 10 30 50 70 90"
SIX="tova h2o scissorhands snapkv:pool_kernel=1,obs_window=16 snapkv:pool_kernel=5,obs_window=16 streaming-llm:sinks=4"
ALL="$SIX streaming-llm:sinks=0 random knorm"
$N --lengths 256 --seeds 0 --prompt-modes decode --budgets 64 128 --policies $SIX
$N --lengths 256 --seeds 0 1 --prompt-modes prefill --budgets 64 128 --policies $ALL
$N --lengths 512 --seeds 0 1 --prompt-modes prefill --budgets 64 128 256 --policies $ALL
$N --lengths 1024 --seeds 0 --prompt-modes prefill --budgets 64 128 256 --policies $ALL
$N --lengths 512 --seeds 0 1 --prompt-modes prefill --granularity kv-head --budgets 128 --policies $ALL
.venv/bin/python -m kvviz.studies.needle_report traces/needle --predictors --write
