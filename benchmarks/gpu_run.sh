#!/usr/bin/env bash
# Everything the project measures on the lent GPU, in ONE device call: the GPU tests, then the GPU
# benchmarks, each guarded (a missing script or a failure is logged and the rest still run) and
# each under its own time limit, all within the call's budget; then ONE file, $OUT/out.tgz (the
# device returns at most 8 files), holds what they produced.
#
#   bash benchmarks/gpu_run.sh                      # tests + every benchmark below
#   bash benchmarks/gpu_run.sh tests teacher_forcing-bodies # only those steps, in that order
#   bash benchmarks/gpu_run.sh ranks-kill           # kill -9 of a NCCL learner rank (two GPUs)
#   BUDGET_S=570 (default): seconds the whole call may take, packing included; a step gets at most
#   what is left of it less PACK_S (20 s), so out.tgz is written even when a step runs long.
#
# Wheels the device lacks travel in .whl/ (carried with the working tree): installed with --no-index
# into /tmp/site ($SITE), first on PYTHONPATH, beside this checkout's src/.
# Inside out.tgz, paths are the repository's, so `tar xzf out.tgz` at the repository root puts the
# raw results where docs/render.py reads them:
#   benchmarks/results/gpu_tests-cuda.json   the GPU tests' summary (benchmarks/gpu_test_summary.py)
#   benchmarks/results/<name>-cuda.json      each benchmark's raw result
#   gpu-run/                                 logs (one per step), junit XML, steps.tsv (step, exit
#                                            status, seconds; 124 = its time limit), nvidia-smi
#   any other file a step wrote under benchmarks/results/ or experiments/results/ of the checkout
set -u
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET_S=${BUDGET_S:-570}
PACK_S=20
OUT=${OUT:-/tmp/gpu-run-out}
STAGE=$(mktemp -d)
LOGS=$STAGE/gpu-run
RESULTS=$STAGE/benchmarks/results
mkdir -p "$OUT" "$LOGS" "$RESULTS"
touch "$STAGE/.start"
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}

# name | seconds at most | command (--out is added: the step's raw JSON goes to $RESULTS/<name>-cuda.json)
BENCHMARKS=(
  "fused_kernel|60|benchmarks/fused_kernel.py --device cuda"
  "teacher_forcing-bodies|490|benchmarks/teacher_forcing.py --device cuda --shapes qwen3-0.6b,qwen3-4b --methods engine-eager,engine-liger,engine-compiled,naive,numerics"
  "teacher_forcing-1.7b|300|benchmarks/teacher_forcing.py --device cuda --shapes qwen3-1.7b --methods engine-eager,engine-compiled,naive,numerics,profile"
  "teacher_forcing-modes|300|benchmarks/teacher_forcing.py --device cuda --shapes qwen3-0.6b --methods engine-compiled,engine-compiled-autotune,engine-compiled-graphs,profile"
  "teacher_forcing-graphs|400|benchmarks/teacher_forcing.py --device cuda --shapes qwen3-0.6b,qwen3-1.7b --methods engine-compiled,engine-compiled-cudagraphs,naive,profile,profile-cudagraphs"
  "teacher_forcing-graphs-eager|150|benchmarks/teacher_forcing.py --device cuda --shapes qwen3-0.6b --methods engine-eager,engine-eager-cudagraphs,naive"
  "learner_step|400|benchmarks/learner_step.py --device cuda --world-size 2 --layouts default,root-kept,kept,prefetch,kept-prefetch"
  "learner_ranks|200|benchmarks/learner_ranks.py --device cuda --ranks 2"
  "serve_throughput|330|benchmarks/serve_throughput.py --device cuda --repeats 3"
  "serve_throughput-clients|330|benchmarks/serve_throughput.py --device cuda --repeats 3 --clients 4"
  "serve_throughput-thread|330|benchmarks/serve_throughput.py --device cuda --repeats 3 --no-engine-process"
  "serve_throughput-clients-thread|330|benchmarks/serve_throughput.py --device cuda --repeats 3 --clients 4 --no-engine-process"
  "serve_sustained|540|benchmarks/serve_sustained.py --device cuda"
  "serve_sustained-streams|560|benchmarks/serve_sustained.py --device cuda --servers thread,process"
  "serve_batcher|200|benchmarks/serve_batcher.py --device cuda"
  "serve_sustained-moe|240|benchmarks/serve_sustained.py --device cuda --model models/tiny-moe --shape none --servers thread"
  "serve_throughput-long|200|benchmarks/serve_throughput.py --device cuda --repeats 3 --model models/tiny-dense --shape none --max-tokens 256"
  "sampler_cpu|40|benchmarks/sampler_cpu.py --device cuda"
  "serve_profile|150|benchmarks/serve_profile.py --device cuda"
  "decode_shapes|200|benchmarks/decode_shapes.py --device cuda --profile --requests 128 --conditions exact,buckets"
  "serve_sustained-moe-process|320|benchmarks/serve_sustained.py --device cuda --model models/tiny-moe --shape none --servers thread,process"
  "serve_sustained-moe-buckets|320|benchmarks/serve_sustained.py --device cuda --model models/tiny-moe --shape none --servers thread,thread-exact"
  "serve_sustained-default|420|benchmarks/serve_sustained.py --device cuda --servers process"
  "serve_throughput-tiny|200|benchmarks/serve_throughput.py --device cuda --repeats 3 --shape none"
  "serve_request_cost|150|benchmarks/serve_request_cost.py --device cuda"
  "decode_profile|200|benchmarks/decode_profile.py --device cuda --kv padded,slots,graphs"
)
# The limits add up to more than one call's 600 s (tests ~1–2 min, fused_kernel ~20 s, the other
# three about 3 min each by their authors' estimates): the budget cuts the last steps short and the
# log says so; name the steps to split them over two calls.
TESTS_S=150

log() { echo "[gpu_run $(date -u +%T) +$((SECONDS - START))s] $*" | tee -a "$LOGS/run.log"; }

pack() {
  trap - EXIT
  # Results a script wrote into the checkout itself (besides or instead of --out) come along too.
  local extra
  find benchmarks/results experiments/results -type f -newer "$STAGE/.start" 2>/dev/null | while read -r extra; do
    [ -e "$STAGE/$extra" ] || { mkdir -p "$STAGE/$(dirname "$extra")" && cp "$extra" "$STAGE/$extra"; }
    log "also packed $extra (written in the checkout)"
  done
  rm -f "$STAGE/.start"
  log "packing into $OUT/out.tgz"
  tar czf "$OUT/out.tgz" -C "$STAGE" . && rm -rf "$STAGE"
  ls -la "$OUT"
}
trap pack EXIT

# Seconds a step may run: its own limit, or what the budget has left after packing, whichever is less.
limit_for() {
  local left=$((BUDGET_S - PACK_S - (SECONDS - START)))
  echo $(($1 < left ? $1 : left))
}

# step NAME LIMIT COMMAND...: run it under `timeout`, log it, record its status and duration.
step() {
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  if [ "$limit" -le 5 ]; then
    log "$name: skipped, the budget is spent"
    printf '%s\tskipped\t0\n' "$name" >> "$LOGS/steps.tsv"
    return
  fi
  log "$name: up to ${limit}s: $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) >> "$LOGS/steps.tsv"
  log "$name: exit $rc after $((SECONDS - t0))s$([ $rc = 124 ] && echo ' (its time limit)')"
  tail -5 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$LOGS/run.log"
}

nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else ''); import triton; print('triton', triton.__version__)" \
  2>&1 | tee -a "$LOGS/run.log"

run_tests() {
  if ! "$PY" -c "import pytest" > /dev/null 2>&1; then
    log "tests: pytest is not installed here: carry its wheels in .whl/ (pytest, pluggy, iniconfig)"
    printf 'tests\tno-pytest\t0\n' >> "$LOGS/steps.tsv"
    return
  fi
  # --noconftest: the suite's conftest needs the server packages; this file needs none of it.
  step tests "$TESTS_S" "$PY" -m pytest tests/test_gpu_kernels.py tests/test_gpu_learner_head.py \
    tests/test_sampling.py tests/test_serve_batching.py tests/test_gpu_graphs.py tests/test_decode_slots.py --noconftest -p no:cacheprovider \
    -o addopts="" -rs --durations=10 --junitxml="$LOGS/gpu_tests.xml"
  step tests-summary 60 "$PY" benchmarks/gpu_test_summary.py "$LOGS/gpu_tests.xml" \
    --out "$RESULTS/gpu_tests-cuda.json"
}

# A learner rank killed -9 mid-run under NCCL on two GPUs: the trainer stops within the test's
# STOP_S (a stuck collective falls to train/ranks.py's interrupt or its GRACE_S exit) and resumes.
run_ranks_kill() {
  step ranks-kill 300 "$PY" -m pytest tests/test_train_ranks.py -k "killed and cuda" --noconftest \
    -p no:cacheprovider -o addopts="" -rs -s --junitxml="$RESULTS/ranks_kill-cuda.xml"
  # The test prints how long the trainer took to stop; docs/render.py quotes it from this copy.
  cp "$LOGS/ranks-kill.log" "$RESULTS/ranks_kill-cuda.log" 2>/dev/null
  nvidia-smi --query-gpu=name --format=csv,noheader > "$RESULTS/ranks_kill-cuda.gpus" 2>/dev/null
}

run_benchmark() {
  local entry
  for entry in "${BENCHMARKS[@]}"; do
    IFS='|' read -r name limit command <<< "$entry"
    [ "$name" = "$1" ] || continue
    local script=${command%% *}
    if [ ! -f "$script" ]; then
      log "$name: $script is not in this checkout: skipped"
      printf '%s\tmissing\t0\n' "$name" >> "$LOGS/steps.tsv"
      return
    fi
    # shellcheck disable=SC2086  # the command's words are split on purpose
    step "$name" "$limit" "$PY" $command --out "$RESULTS/$name-cuda.json"
    return
  done
  log "$1: no such step (tests, or one of: ${BENCHMARKS[*]%%|*})"
}

steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
  steps=(tests)
  for entry in "${BENCHMARKS[@]}"; do steps+=("${entry%%|*}"); done
fi
for name in "${steps[@]}"; do
  case $name in
    tests) run_tests ;;
    ranks-kill) run_ranks_kill ;;
    *) run_benchmark "$name" ;;
  esac
done
log "done: $(tr '\n' ' ' < "$LOGS/steps.tsv")"
