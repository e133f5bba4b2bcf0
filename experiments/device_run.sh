#!/usr/bin/env bash
# Run experiments (a) and (b) on a machine with many CPU cores (the lent GPU machine's host CPUs:
# the experiments run on the CPU). Wheels for the packages that machine lacks travel in .whl/.
#   bash experiments/device_run.sh start   # start both campaigns in the background
#   bash experiments/device_run.sh wait S  # wait up to S seconds, then pack the results into $OUT
set -u
cd "$(dirname "$0")/.."
EXP=/tmp/exp
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
case "$1" in
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p $EXP
  setsid nohup python3 -m rollmarket campaign configs/exp-a-campaign.toml --out $EXP/exp-a --parallel "${A_PARALLEL:-8}" \
    > $EXP/a.log 2>&1 < /dev/null &
  (cd experiments && setsid nohup python3 training_step.py --seeds 8 --steps 8 --parallel "${B_PARALLEL:-8}" \
    --out $EXP/exp-b eval.tasks=50 eval.samples=16 > $EXP/b.log 2>&1 < /dev/null &)
  ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ]; do
    a=$(ls $EXP/exp-a/runs/*/*/summary.json 2>/dev/null | wc -l); b=$(ls $EXP/exp-b/runs/*/*/summary.json 2>/dev/null | wc -l)
    echo "$(date -u +%T) exp-a $a/8 exp-b $b/32 report $(test -f $EXP/exp-b/report.json && echo yes || echo no)"
    if [ "$a" = 8 ] && [ -f $EXP/exp-b/report.json ]; then break; fi
    if ! pgrep -f "rollmarket campaign|training_step.py" > /dev/null; then echo "no experiment process left"; break; fi
    sleep 30
  done
  tail -5 $EXP/a.log; tail -25 $EXP/b.log
  (cd $EXP && tar czf $OUT/results.tgz --exclude=checkpoints --exclude=exchange.db --exclude=generations.jsonl \
     --exclude=workers --exclude=logs --exclude='*.lock' exp-a exp-b a.log b.log 2>/dev/null)
  ls -la $OUT
  ;;
esac
