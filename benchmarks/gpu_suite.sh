#!/usr/bin/env bash
# The checks a session with a GPU runs first: one command, within 43 minutes on one H100 or H200,
# writing everything under benchmarks/results/gpu_suite_DATE_DEVICE_torchVERSION/ (summary.md, each
# step's log and JSON figures; the JSONs' meta repeat device, torch, transformers and date).
#
#   bash benchmarks/gpu_suite.sh                  # every step, in order (not the quick ones)
#   bash benchmarks/gpu_suite.sh quick            # the figures that matter most, in one 8-minute call
#   bash benchmarks/gpu_suite.sh memory smoke     # only these steps (each fits one device `run` call, ≤ 600 s)
#   bash benchmarks/gpu_suite.sh --list           # the steps, their budgets and the quick selection
#   bash benchmarks/gpu_suite.sh --cpu [STEP...]  # the steps at CPU sizes, 4× the time: a check of the suite
#
# Without CUDA (and without --cpu) it prints every command it would run and exits 0; CI never runs it.
# Each step runs under `timeout` at its budget (below; 2550 s = 42.5 min in all), so a step that
# hangs costs at most its budget and the others still run; the exit code is 1 when a step failed.
# On a lent machine (the device tool's `run`: at most 600 s a call; 15 minutes a session), call
# `quick` first: train_quick (the bf16 trainer against the transformers loop at 1B, compiled, and
# float8 tensorwise compiled against bf16) and smoke_quick (the smoke run at 8 steps), 470 s in all,
# leaving time to rerun one. Then, in this order as time is left, one call each: `train_fp8` (540 s:
# float8 tensorwise and rowwise, eager and compiled, against bf16), `env activations smoke` (570 s),
# `memory` (420 s), `train_32k` (480 s), `train_128k` (540 s). Where the tool's $OUT is set the
# folder is packed into $OUT after each step (unpack it into benchmarks/results/; a later call on the
# same warm machine adds to the folder there).
# Setup: where libai_zoo is not importable (a bare GPU machine: its own torch and transformers, no
# internet), the wheels in .whl/ (the call carries ".whl") go to /tmp and the checkout is installed
# editable, without dependencies; torchao's wheel too where torchao is not importable. The machine
# has torch 2.11 (below the project's 2.13 floor: the suite runs on it all the same), transformers,
# accelerate, huggingface_hub, safetensors, pyarrow, pandas; fill .whl/ here (ignored by git) with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0 datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19 torchao==0.18.0
# (4.4 MB; one version of each). torchao 0.18.0 is the project's (".[fp8]") and takes torch >= 2.11
# (its import gate; it still clamps float8 casts for 2.11's eager mode); 0.16 was built for torch
# 2.10 alone. Its float8 training needs torch._scaled_mm, none of its own kernels. Without torchao the
# float8 runs are skipped, saying what is missing, and the bf16 runs are still measured.
set -u
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
PY=${PYTHON:-python3}

# step: budget in seconds (the time it may take on one H100/H200) and what it does. The correctness
# checks come first, the throughput benchmarks (the longest, measured before) last. The quick steps
# are the `quick` selection's, outside the full order (they repeat parts of smoke, train_32k, train_fp8).
STEPS=(env activations smoke memory train_32k train_128k train_fp8)
QUICK=(train_quick smoke_quick)
declare -A BUDGET=([env]=30 [activations]=180 [smoke]=360 [memory]=420 [train_32k]=480 [train_128k]=540
                   [train_fp8]=540 [train_quick]=320 [smoke_quick]=150)
declare -A ABOUT=(
  [env]="device, driver, torch, transformers, commit"
  [activations]="tests/test_planner_activations.py on the GPU: the planner's activation bytes against \
what CUDA's kernels save"
  [smoke]="tools/train.py on the tiny GPT-2: fp32, AMP bf16/fp16, compile, torchrun (ZeRO-3 where 2 GPUs), \
async checkpoint, resume, generation"
  [memory]="the planner's predicted peak against torch.cuda.max_memory_allocated: TinyLlama 1.1B, \
each recomputation choice, the loss whole and chunked"
  [train_32k]="bench_train: Llama 1B bf16, trainer vs transformers, eager and compiled, vocabulary 32k"
  [train_128k]="bench_train: the same at vocabulary 128k"
  [train_fp8]="bench_train: Llama 1B, the trainer in bf16 against float8 (torchao; tensorwise, rowwise), \
eager and compiled: tokens/s (target: float8 compiled >= 1.25x bf16 compiled), MFU (bf16 peak), peak memory, \
loss after the same steps (target: within 2%)"
  [train_quick]="(quick) bench_train: Llama 1B compiled, the bf16 trainer vs the transformers loop, and float8 \
tensorwise vs bf16"
  [smoke_quick]="(quick) the smoke step at 8 steps a run"
)
# which lines of a step's log go into summary.md
BENCH_TRAIN_FIGURES="parameters|MFU against|tokens/s|x$|loss after|skipped|FAILED"
declare -A FIGURES=(
  [env]="^(PyTorch|CUDA used|GPU models|Nvidia driver|Python) version|^Name:|^Version:|^commit"
  [activations]="error [0-9]|passed|failed" [smoke]="PASS|FAIL" [memory]="keys:|predicted / measured"
  [train_32k]=$BENCH_TRAIN_FIGURES [train_128k]=$BENCH_TRAIN_FIGURES [train_fp8]=$BENCH_TRAIN_FIGURES
  [train_quick]=$BENCH_TRAIN_FIGURES [smoke_quick]="PASS|FAIL"
)

STEP_FAILED=0
run() {  # one command of a step: printed in the dry run, executed (echoed first) otherwise
  if [ "${GPU_SUITE_MODE:-}" = print ]; then
    local word words=()
    for word in "$@"; do [[ $word =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]] && words+=("$word") || words+=("'$word'"); done
    echo "    ${words[*]}"
  else
    echo "+ $*"
    "$@" || STEP_FAILED=1
  fi
}

cpu() { [ "${GPU_SUITE_CPU:-0}" = 1 ]; }

step_env() {
  run "$PY" -m torch.utils.collect_env
  run "$PY" -m pip show transformers
  if git rev-parse --git-dir >/dev/null 2>&1; then  # a device machine's copy of the tree may have no .git
    run git log -1 --format="commit %H %cd %s"
  fi
}

step_activations() {
  local device=cuda
  cpu && device=cpu
  run env LIBAI_ZOO_TEST_DEVICE=$device LIBAI_ZOO_DURATIONS_SLACK=0 "$PY" -m pytest -q -s -p no:cacheprovider \
    tests/test_planner_activations.py
}

step_smoke() {  # steps a run (default: feature_smoke.py's 20)
  if cpu; then
    run "$PY" benchmarks/feature_smoke.py --steps 4 --out "$DIR/smoke.json"
  else
    run "$PY" benchmarks/feature_smoke.py ${1:+--steps $1} --out "$DIR/smoke${1:+_$1steps}.json"
  fi
  if [ "${GPU_SUITE_MODE:-}" = print ]; then  # what it runs
    "$PY" benchmarks/feature_smoke.py --dry-run ${1:+--steps $1} | sed 's/^/        /'
  fi
}
step_smoke_quick() { step_smoke 8; }

step_memory() {
  if cpu; then
    run "$PY" benchmarks/bench_planner_memory.py --preset tiny --micro-batches 1,2 --loss-chunks 0,1 \
      --out "$DIR/memory_tiny.json"
  else
    run "$PY" benchmarks/bench_planner_memory.py --preset 1b --amp --micro-batches 2,4 --loss-chunks 0,256 \
      --out "$DIR/memory_1b.json"
  fi
}

train() {  # vocabulary size
  if cpu; then
    run "$PY" benchmarks/bench_train.py --preset cpu --vocab "$1" --steps 3 --warmup 1 --runs trainer,transformers \
      --out "$DIR/train_cpu_v$1.json"
  else
    run "$PY" benchmarks/bench_train.py --preset 1b --vocab "$1" --steps 15 --warmup 5 --out "$DIR/train_1b_v$1.json"
  fi
}
step_train_32k() { train 32000; }
step_train_128k() { train 128256; }

float8_note() {  # in the dry run: what the float8 runs need
  if [ "${GPU_SUITE_MODE:-}" = print ]; then
    echo "        # the float8 runs need torchao (0.18.0: torch >= 2.11; .whl/ or installed); without it they are"
    echo "        # skipped, saying what is missing, and the bf16 runs are still measured"
  fi
}

step_train_fp8() {  # the compiled runs first: the target's figures
  if cpu; then  # CPU float8 GEMMs are slow: the smallest sizes that run each path
    run "$PY" benchmarks/bench_train.py --preset cpu --layers 2 --seq 128 --batch 2 --steps 2 --warmup 1 \
      --runs trainer_compiled,trainer_fp8_tensorwise_compiled,trainer,trainer_fp8_tensorwise,trainer_fp8_rowwise \
      --out "$DIR/train_fp8_cpu.json"
  else
    local runs=trainer_compiled,trainer_fp8_tensorwise_compiled,trainer_fp8_rowwise_compiled
    run "$PY" benchmarks/bench_train.py --preset 1b --vocab 32000 --steps 15 --warmup 5 \
      --runs $runs,trainer,trainer_fp8_tensorwise,trainer_fp8_rowwise --out "$DIR/train_fp8_1b.json"
  fi
  float8_note
}

step_train_quick() {  # compiled only: the trainer against transformers, float8 against bf16
  if cpu; then
    run "$PY" benchmarks/bench_train.py --preset cpu --layers 2 --seq 128 --batch 2 --steps 2 --warmup 1 \
      --runs trainer_compiled,transformers_compiled,trainer_fp8_tensorwise_compiled --out "$DIR/train_quick_cpu.json"
  else
    run "$PY" benchmarks/bench_train.py --preset 1b --vocab 32000 --steps 12 --warmup 4 \
      --runs trainer_compiled,transformers_compiled,trainer_fp8_tensorwise_compiled --out "$DIR/train_quick_1b.json"
  fi
  float8_note
}

ensure_env() {  # libai_zoo and its pure-Python dependencies importable, on a bare GPU machine too
  local wheels=/tmp/libai_zoo_wheels
  [ -d $wheels ] && export PYTHONPATH=$wheels${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c "import omegaconf, datasets" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $wheels .whl/*.whl
    export PYTHONPATH=$wheels${PYTHONPATH:+:$PYTHONPATH}
  fi
  if ! "$PY" -c "import torchao" 2>/dev/null && compgen -G ".whl/torchao-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $wheels \
      .whl/torchao-*.whl
    export PYTHONPATH=$wheels${PYTHONPATH:+:$PYTHONPATH}
  fi
  if ! (cd /tmp && "$PY" -c "import libai_zoo.layers") 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  fi
  if ! (cd /tmp && "$PY" -c "import libai_zoo.layers, omegaconf"); then
    echo "libai_zoo is not importable with $PY: install it (pip install -e .) and its dependencies" \
         "(or carry their wheels in .whl/), then run the suite again" >&2
    exit 1
  fi
  if ! "$PY" -c "import torchao.float8" 2>/dev/null; then
    echo "torchao is not importable with $PY: the float8 runs (train_fp8, train_quick) will be skipped, saying" \
         "what is missing; carry torchao's wheel in .whl/ (the header says how)" >&2
  fi
}

pack() {  # the results into the device tool's $OUT, so they come back even if the call is cut off
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    tar czf "$OUT/$(basename "$DIR").tgz" -C "$(dirname "$DIR")" "$(basename "$DIR")"
    cp "$DIR/summary.md" "$OUT/"
  fi
}

# ------------------------------------------------------------------------------------------ main
if [ "${1:-}" = --inner ]; then  # one step, under the caller's timeout
  "step_$2"
  exit $STEP_FAILED
fi
GPU_SUITE_CPU=0
SELECTED=()
for arg in "$@"; do
  case $arg in
    --list) for s in "${STEPS[@]}" "${QUICK[@]}"; do
              printf '%-12s %4s s  %s\n' "$s" "${BUDGET[$s]}" "${ABOUT[$s]}"
            done
            quick=0; for s in "${QUICK[@]}"; do quick=$((quick + BUDGET[$s])); done
            echo "quick = ${QUICK[*]}: $quick s, one 8-minute call; then one call each, as time is left:" \
                 "train_fp8 | env activations smoke | memory | train_32k | train_128k"
            exit 0 ;;
    --cpu) GPU_SUITE_CPU=1 ;;
    -h|--help) sed -n '2,/^set -u$/{/^#/p}' "$SELF" | sed 's/^# \{0,1\}//'; exit 0 ;;
    quick) SELECTED+=("${QUICK[@]}") ;;
    *) if [ -z "${BUDGET[$arg]:-}" ]; then
         echo "unknown step '$arg': the steps are ${STEPS[*]} ${QUICK[*]}, the selection quick" >&2; exit 2
       fi
       SELECTED+=("$arg") ;;
  esac
done
[ ${#SELECTED[@]} -eq 0 ] && SELECTED=("${STEPS[@]}")
export GPU_SUITE_CPU PY

total=0
for s in "${SELECTED[@]}"; do total=$((total + BUDGET[$s])); done
if [ $GPU_SUITE_CPU = 0 ] && ! { command -v nvidia-smi >/dev/null &&
    "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }; then
  DIR="benchmarks/results/gpu_suite_DATE_DEVICE_torchVERSION"
  echo "No CUDA device here: the GPU suite is not run. On a GPU it would run these steps (${total} s at most):"
  for s in "${SELECTED[@]}"; do
    echo "[$s] budget ${BUDGET[$s]} s: ${ABOUT[$s]}"
    GPU_SUITE_MODE=print "step_$s"
  done
  echo "Results would go to $DIR/ (summary.md, STEP.log, the steps' JSON)."
  exit 0
fi

ensure_env
read -r DEVICE TORCH < <("$PY" -c "import re, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() and '$GPU_SUITE_CPU' == '0' else 'cpu'
print(re.sub(r'[^a-z0-9]+', '-', name.lower().replace('nvidia', '')).strip('-').split('-')[0], torch.__version__)")
NAME="gpu_suite_$(date -u +%F)_${DEVICE}_torch${TORCH%%+*}"
if [ $GPU_SUITE_CPU = 1 ]; then
  DIR=${GPU_SUITE_RESULTS:-$(mktemp -d)}/$NAME  # a check of the suite: its figures are not results
else
  DIR=${GPU_SUITE_RESULTS:-benchmarks/results}/$NAME
fi
mkdir -p "$DIR"
export DIR
summarize() {  # summary.md from the steps run so far (in this call and earlier ones into $DIR)
  { echo "# GPU suite: $DEVICE, torch $TORCH, $(date -u +%F)"
    echo
    echo "\`bash benchmarks/gpu_suite.sh\` (README.md, Benchmarks); each step's log and JSON are beside this file."
    echo
    echo "| step | status | seconds | budget | started (UTC) |"
    echo "|---|---|---|---|---|"
    cat "$DIR/steps.md"
    echo
    echo '```'
    cat "$DIR/figures.txt"
    echo '```'; } > "$DIR/summary.md"
}

echo "GPU suite: ${SELECTED[*]} (${total} s at most); results in $DIR"
failed=0
for s in "${SELECTED[@]}"; do
  echo "=== $s (budget ${BUDGET[$s]} s): ${ABOUT[$s]}"
  started=$(date -u +%T)
  start=$(date +%s)
  timeout -k 15 $((BUDGET[$s] * (1 + 3 * GPU_SUITE_CPU))) bash "$SELF" --inner "$s" > "$DIR/$s.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  case $rc in
    0) status=PASS ;;
    124|137) status="TIMEOUT"; failed=1 ;;
    *) status="FAIL (exit $rc)"; failed=1 ;;
  esac
  echo "| $s | $status | $seconds | ${BUDGET[$s]} | $started |" >> "$DIR/steps.md"
  { echo "[$s] $status in $seconds s"
    grep -E "${FIGURES[$s]}" "$DIR/$s.log" | grep -v '^+ ' | sed 's/^/    /'; } | tee -a "$DIR/figures.txt"
  [ $rc = 0 ] || tail -n 30 "$DIR/$s.log"
  summarize
  pack
done
echo "Summary: $DIR/summary.md"
exit $failed
