#!/usr/bin/env bash
# Run experiments (a) and (b)'s campaigns on a machine with many CPU cores (the lent GPU machine's
# host CPUs: the experiments run on the CPU). Wheels for the packages that machine lacks travel in .whl/.
#   bash experiments/device_run.sh start   # start both campaigns in the background
#   bash experiments/device_run.sh wait S  # wait up to S seconds, then pack the results into $OUT
# ONLY=b runs (b) alone; A_PARALLEL / B_PARALLEL set the runs at once (default 8 and 24).
set -u
cd "$(dirname "$0")/.."
EXP=/tmp/exp
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
case "$1" in
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p $EXP
  if [ "${ONLY:-}" != b ]; then
    setsid nohup python3 -m rollmarket campaign configs/exp-a-campaign.toml --out $EXP/exp-a --parallel "${A_PARALLEL:-8}" \
      > $EXP/a.log 2>&1 < /dev/null &
  fi
  setsid nohup python3 -m rollmarket campaign configs/exp-b-campaign.toml --out $EXP/exp-b --parallel "${B_PARALLEL:-24}" \
    > $EXP/b.log 2>&1 < /dev/null &
  ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ]; do
    a=$(ls $EXP/exp-a/runs/*/*/summary.json 2>/dev/null | wc -l); b=$(ls $EXP/exp-b/runs/*/*/summary.json 2>/dev/null | wc -l)
    echo "$(date -u +%T) exp-a $a/8 exp-b $b/24"
    if { [ "$a" = 8 ] || [ "${ONLY:-}" = b ]; } && [ "$b" = 24 ]; then break; fi
    if ! pgrep -f "rollmarket campaign" > /dev/null; then echo "no experiment process left"; break; fi
    sleep 30
  done
  tail -5 $EXP/a.log $EXP/b.log 2>/dev/null
  (cd $EXP && python3 -m rollmarket stats exp-b > b.stats.txt 2>&1; \
   tar czf $OUT/results.tgz --exclude=checkpoints --exclude=exchange.db --exclude=generations.jsonl \
     --exclude=workers --exclude=logs --exclude='*.lock' $(ls -d exp-a exp-b 2>/dev/null) *.log b.stats.txt 2>/dev/null)
  ls -la $OUT
  ;;
esac
