#!/bin/sh
# The study of the tasks built for the cards' claims (docs/studies/tasks.md): recall, phrase and
# distractors prompts on SmolLM2, every policy answering over its own evicted cache, into
# traces/tasks/, then the report (docs/studies/tasks.md and README.md there, traces/tasks/answers.json).
#
#   ./lab/tasks_study.sh                everything, one prompt after another (resumable:
#                                       re-run it after a kill; finished prompts are kept)
#   ./lab/tasks_study.sh decode         only the decode-mode prompts
#   ./lab/tasks_study.sh prefill        only the prefill-mode prompts at 256 and 512 tokens
#   ./lab/tasks_study.sh long           only the long prompts (2,048 tokens, prefill
#                                       mode, every evicting cache freed to its budget)
#   ./lab/tasks_study.sh report         only the report
#
# decode, prefill and long may run at the same time (a core each): each prompt is its own file.
set -e
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
PART=${1:-all}
N=".venv/bin/python -m kvviz needle --out traces/tasks --threads 1"
S30="--seeds $(seq -s " " 0 29)"
DECODE="tova h2o scissorhands snapkv:pool_kernel=1,obs_window=16 snapkv:pool_kernel=5,obs_window=16"
ALL="$DECODE streaming-llm:sinks=4 knorm random adakv:scorer=tova pyramidkv:scorer=tova"

if [ "$PART" = all ] || [ "$PART" = decode ]; then
  # a key the text returns to every K sentences (K = 20 leaves no room for a reminder at 256
  # tokens: the pass-key prompt, token for token), read token by token, evicting as it goes;
  # then the attention the key receives at each step, for the Forgetting view's chart
  for K in 20 3 5; do
    $N --task recall --reminder-every $K --lengths 256 --depths 10 $S30 --prompt-modes decode \
       --budgets 128 192 --policies $DECODE
  done
  # at 512 tokens a reminder every 20 sentences (three reminders about a hundred tokens apart),
  # against the same prompt with none (K = 1000)
  for K in 20 1000; do
    $N --task recall --reminder-every $K --lengths 512 --depths 10 $S30 --prompt-modes decode \
       --budgets 384 --policies $DECODE
  done
  .venv/bin/python -m lab.key_attention traces/tasks --threads 1
fi
if [ "$PART" = all ] || [ "$PART" = prefill ]; then
  for K in 20 3 10 5; do
    $N --task recall --reminder-every $K --lengths 256 --depths 10 $S30 --prompt-modes prefill \
       --budgets 64 128 192 --policies $ALL
  done
  for K in 20 5; do
    $N --task recall --reminder-every $K --lengths 512 --depths 10 $S30 --prompt-modes prefill \
       --budgets 64 128 --policies $ALL
  done
  $N --task phrase --phrase-words 4 --max-new-tokens 12 --lengths 512 --depths 10 50 90 $S30 \
     --prompt-modes prefill --budgets 64 128 --policies $ALL
  $N --task distractors --distractors 2 --lengths 512 --depths 10 50 90 $S30 \
     --prompt-modes prefill --budgets 64 128 --policies $ALL
fi
if [ "$PART" = all ] || [ "$PART" = long ]; then
  for LEN in 2048; do
    $N --task phrase --phrase-words 4 --max-new-tokens 12 --lengths $LEN --depths 50 $S30 \
       --prompt-modes prefill --budgets 256 512 --policies $DECODE --eviction freed
    $N --task recall --reminder-every 5 --lengths $LEN --depths 10 $S30 \
       --prompt-modes prefill --budgets 256 512 --policies $DECODE --eviction freed
  done
fi
if [ "$PART" = all ] || [ "$PART" = report ]; then
  .venv/bin/python -m lab.tasks_report traces/tasks --write
fi
