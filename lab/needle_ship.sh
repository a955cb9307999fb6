#!/bin/sh
# The shipped pass-key grid (README, "The pass-key test"): SmolLM2, three depths, each depth
# with its own ten seeds, so every cell of the report has 30 distinct keys; into
# traces/needle/, then the report (docs/benchmarks.md's table and answers, docs/studies/needle.md).
# Resumable: re-run it after a kill. setup.py's NEEDLE lists the files this writes; change
# both together.
set -e
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
N=".venv/bin/python -m kvviz needle --out traces/needle"
SIX="tova h2o scissorhands snapkv:pool_kernel=1,obs_window=16 snapkv:pool_kernel=5,obs_window=16 streaming-llm:sinks=4"
ALL="$SIX streaming-llm:sinks=0 random knorm"
D10="--depths 10 --seeds 0 1 2 3 4 5 6 7 8 9"
D50="--depths 50 --seeds 10 11 12 13 14 15 16 17 18 19"
D90="--depths 90 --seeds 20 21 22 23 24 25 26 27 28 29"
$N --lengths 256 $D10 --prompt-modes decode --budgets 128 --policies $SIX
$N --lengths 256 $D50 --prompt-modes decode --budgets 128 --policies $SIX
$N --lengths 256 $D90 --prompt-modes decode --budgets 128 --policies $SIX
$N --lengths 256 $D10 --prompt-modes prefill --budgets 64 128 --policies $ALL
$N --lengths 256 $D50 --prompt-modes prefill --budgets 64 128 --policies $ALL
$N --lengths 256 $D90 --prompt-modes prefill --budgets 64 128 --policies $ALL
$N --lengths 512 $D10 --prompt-modes prefill --budgets 64 128 256 --policies $ALL
$N --lengths 512 $D50 --prompt-modes prefill --budgets 64 128 256 --policies $ALL
$N --lengths 512 $D90 --prompt-modes prefill --budgets 64 128 256 --policies $ALL
$N --lengths 512 $D10 --prompt-modes prefill --granularity kv-head --budgets 128 --policies $ALL
$N --lengths 512 $D50 --prompt-modes prefill --granularity kv-head --budgets 128 --policies $ALL
$N --lengths 512 $D90 --prompt-modes prefill --granularity kv-head --budgets 128 --policies $ALL
.venv/bin/python -m lab.needle_report traces/needle --predictors --write
