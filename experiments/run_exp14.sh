#!/usr/bin/env bash
# Issue 14's experiments (a), (b) and (c), and issue 17's (d) router replay (campaign `r`), on a machine
# with many CPU cores (the runs use the CPU; one torch thread per process). Wheels for packages that
# machine lacks travel in .whl/ (a folder of wheels for that machine's Python, carried with the
# working tree).
#   bash experiments/run_exp14.sh start [a|b|c|r|abc] # start the campaigns in the background
#   bash experiments/run_exp14.sh wait S            # wait up to S seconds, then pack into $OUT/out.tgz
# Packing: ONE file, $OUT/out.tgz (the lent machine's output limit counts files: several tarballs
# were once left behind). Inside: results/ — each finished campaign as experiments/pack_campaign.py
# packs it (exp-a2/, exp-c/, exp-b/campaign/, exp-r3/campaign/: raw files and a manifest.json naming
# this machine);
# unfinished/ — every campaign directory as it stands (no checkpoints), resumable by rerunning its
# campaign command on it; and the logs and `rollmarket stats` outputs. Unpack with
#   tar xzf out.tgz && cp -r results/* experiments/results/ && python docs/render.py
# Parallelism: A_PARALLEL (default 16), B_PARALLEL (24), C_PARALLEL (48) and R_PARALLEL (48): every run
# of each at once. (d) alone (48 runs): bash experiments/run_exp14.sh start r
# (b) and (c) together (72 runs) were sized for a 64-core machine: bash experiments/run_exp14.sh start bc
set -u
cd "$(dirname "$0")/.."
EXP=/tmp/exp14
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
A_CMD="rollmarket campaign configs/exp-a-campaign.toml --out $EXP/exp-a2 --parallel ${A_PARALLEL:-16}"
C_CMD="rollmarket campaign configs/exp-c-campaign.toml --out $EXP/exp-c --parallel ${C_PARALLEL:-48}"
B_CMD="rollmarket campaign configs/exp-b-campaign.toml --out $EXP/exp-b --parallel ${B_PARALLEL:-24}"
R_CMD="rollmarket campaign configs/exp-r3-campaign.toml --out $EXP/exp-r3 --parallel ${R_PARALLEL:-48}"
case "$1" in
start)
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  mkdir -p $EXP
  which="${2:-ac}"
  case "$which" in *a*) setsid nohup python3 -m rollmarket ${A_CMD#rollmarket } > $EXP/a.log 2>&1 < /dev/null & ;; esac
  case "$which" in *c*) setsid nohup python3 -m rollmarket ${C_CMD#rollmarket } > $EXP/c.log 2>&1 < /dev/null & ;; esac
  case "$which" in *b*) setsid nohup python3 -m rollmarket ${B_CMD#rollmarket } > $EXP/b.log 2>&1 < /dev/null & ;; esac
  case "$which" in *r*) setsid nohup python3 -m rollmarket ${R_CMD#rollmarket } > $EXP/r.log 2>&1 < /dev/null & ;; esac
  sleep 5; tail -3 $EXP/*.log
  ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ]; do
    a=$(ls $EXP/exp-a2/runs/*/*/summary.json 2>/dev/null | wc -l); c=$(ls $EXP/exp-c/runs/*/*/summary.json 2>/dev/null | wc -l)
    b=$(ls $EXP/exp-b/runs/*/*/summary.json 2>/dev/null | wc -l); r=$(ls $EXP/exp-r3/runs/*/*/summary.json 2>/dev/null | wc -l)
    echo "$(date -u +%T) exp-a2 $a/16 exp-b $b/24 exp-c $c/48 exp-r3 $r/48 load $(cut -d' ' -f1 /proc/loadavg) mem $(free -g | awk '/Mem/{print $3"/"$2}')G"
    if ! pgrep -f "rollmarket campaign configs/exp-" > /dev/null; then echo "no campaign process left"; break; fi
    sleep 30
  done
  tail -5 $EXP/*.log
  mkdir -p $OUT/results
  for name in exp-a2 exp-b exp-c exp-r3; do
    [ -d $EXP/$name ] || continue
    dest=$OUT/results/$name
    case $name in exp-a2) cmd=$A_CMD; q="Does a short CPU run raise held-out sampled pass@1, and is it the reward?";;
                  exp-c) cmd=$C_CMD; q="Which gate thresholds still let training converge when rollouts drift?";;
                  exp-b) cmd=$B_CMD; dest=$OUT/results/exp-b/campaign; q="Does engine drift change what training reaches?";;
                  exp-r3) cmd=$R_CMD; dest=$OUT/results/exp-r3/campaign
                          q="What does router replay do to ESS and to what training reaches, per rollout precision?";; esac
    # (d) compares replay with none at each precision: one `stats` per baseline (stats.json keeps the
    # file's own baseline, written last).
    [ $name = exp-r3 ] && for base in fp16 fp8; do
      python3 -m rollmarket stats $EXP/$name --baseline $base > $EXP/$name.stats-$base.txt 2>&1; done
    python3 -m rollmarket stats $EXP/$name > $EXP/$name.stats.txt 2>&1
    # (d)'s secondary metric (token ESS over the steps) has no value before training: its own gain is pass@1's.
    only=""; [ $name = exp-r3 ] && only="--metric eval/pass@1@final"
    python3 -m rollmarket stats $EXP/$name --before-after $only > $EXP/$name.before-after.txt 2>&1
    python3 experiments/pack_campaign.py $EXP/$name $dest --question "$q" --command "$cmd" \
      --note "${NOTE:-}" > /dev/null || echo "$name not packed (unfinished): see unfinished/"
  done
  mkdir -p $OUT/unfinished
  (cd $EXP && tar cf - --exclude=checkpoints --exclude='exchange.db*' --exclude=generations.jsonl \
     --exclude=workers --exclude=logs --exclude='*.lock' $(ls -d exp-* 2>/dev/null) | tar xf - -C $OUT/unfinished)
  cp $EXP/*.txt $EXP/*.log $OUT/ 2>/dev/null
  (cd $OUT && tar czf out.tgz --remove-files results unfinished $(ls *.txt *.log 2>/dev/null))
  ls -la $OUT
  ;;
esac
