#!/usr/bin/env bash
# The GPU check of rankwatch's native tracepoints (native/README.md, "On a GPU").
#
# On one machine with a GPU, PyTorch (CUDA) and NCCL:
#   1. builds native/ against the machine's CUDA headers;
#   2. starts the host agent writing a capture file (no broker needed: replay it elsewhere with
#      `rankwatch replay`);
#   3. runs a loopback pair of ranks on GPU 0 (train_loop.py: matmuls + a 64 MiB NCCL AllReduce
#      per step). Each rank gets its own NCCL_HOSTID, so NCCL treats them as two hosts and moves
#      the data over its network transport (sockets on lo): proxy ops, steps and chunk counters
#      exist, as between real nodes;
#   4. alternates REPEATS times: baseline (nothing loaded), native (NCCL profiler plugin + CUPTI
#      injector), full (native + the Python tracer with the stage context managers);
#   5. stops the agent and writes summary.json: step-time overhead per variant against the
#      baseline runs, and the records per kind and job that came through the agent.
#
#   bash native/gpu/check.sh            # results in $OUT (default ./gpu-check)
# Settings: OUT, PYTHON (a Python with torch; default python3), STEPS (200), REPEATS (3),
# WHEELS (a directory of wheels for an offline install of orjson and pydantic), DEPS,
# CUDA_HOME (/usr/local/cuda), CAPTURE_STEPS (30: the short run whose capture becomes the
# replay fixture, traced with everything), TRAIN_ARGS (train_loop.py options of the overhead
# runs, e.g. "--mb 1 --matmuls 1" for ~1 ms steps). A fault run (job gpu-stall: rank 1's data loading
# stalls 8 s at step 25) is captured too, as a diagnosis fixture.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-check}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-200}
REPEATS=${REPEATS:-3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CAPTURE_STEPS=${CAPTURE_STEPS:-30}
mkdir -p "$OUT"
log() { printf '[gpu-check %s] %s\n' "$(date +%T)" "$*" >&2; }

log "building native/ against $CUDA_HOME/include"
make -s -C native CUDA_HEADERS="$CUDA_HOME" RANKWATCH_NO_FETCH=1 >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
ls native/build/librankwatch_nccl.so native/build/librankwatch_cupti.so >/dev/null

PY="$PYTHON"
DEPS=${DEPS:-/tmp/rankwatch-gpu-deps}  # orjson and pydantic beside the Python that has torch
if ! "$PY" -c "import orjson, pydantic" 2>/dev/null; then
  log "installing orjson and pydantic into $DEPS"
  "$PY" -m pip install -q --target "$DEPS" ${WHEELS:+--no-index --find-links "$WHEELS"} \
    orjson pydantic
fi
PYTHONPATH="$DEPS" "$PY" -c "import torch, orjson, pydantic; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), torch.cuda.get_device_name(0))" | tee "$OUT/versions.txt"

CUPTI_LIB=$(ls "$CUDA_HOME"/lib64/libcupti.so* 2>/dev/null | head -1 || true)
export RANKWATCH_RING_DIR="$OUT/sidecars" PYTHONPATH="$PWD:$DEPS"
export MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
       NCCL_DEBUG=${NCCL_DEBUG:-WARN}
rm -f "$OUT/steps.jsonl"

log "agent: rings -> $OUT/capture.rwcap"
"$PY" -m rankwatch agent --sidecar-dir "$RANKWATCH_RING_DIR" --capture "$OUT/capture.rwcap" \
  --json >"$OUT/agent.json" 2>"$OUT/agent.log" &
AGENT=$!
trap 'kill $AGENT 2>/dev/null || true' EXIT

port=29600
pair() {  # variant steps job [train_loop args…]
  local variant=$1 steps=$2 job=$3 pids=() env=()
  shift 3
  port=$((port + 1))
  case $variant in
    baseline) ;;
    native|full) env=(NCCL_PROFILER_PLUGIN="$PWD/native/build/librankwatch_nccl.so"
                      CUDA_INJECTION64_PATH="$PWD/native/build/librankwatch_cupti.so"
                      ${CUPTI_LIB:+RANKWATCH_CUPTI_LIB=$CUPTI_LIB}) ;;
  esac
  [ "$variant" = full ] && env+=(RANKWATCH_TRACE_PY=1)
  for r in 0 1; do
    env "${env[@]}" RANK=$r LOCAL_RANK=0 NCCL_HOSTID="rw-gpu-check-$r" MASTER_PORT=$port \
      RANKWATCH_JOB_ID="$job" \
      "$PY" native/gpu/train_loop.py --steps "$steps" --variant "$variant" --job "$job" \
      --out "$OUT/steps.jsonl" "$@" >>"$OUT/ranks.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { tail -40 "$OUT/ranks.log"; exit 1; }; done
}

log "capture run: $CAPTURE_STEPS steps, everything traced (job gpu-capture)"
pair full "$CAPTURE_STEPS" gpu-capture
log "fault run: rank 1's data loading stalls 8 s at step 25 of 40 (job gpu-stall)"
pair full 40 gpu-stall --warmup 0 --stall-rank 1 --stall-step 25 --stall-s 8
for rep in $(seq 1 "$REPEATS"); do
  for variant in baseline native full; do
    log "repeat $rep/$REPEATS: $variant, $STEPS steps"
    # shellcheck disable=SC2086 # TRAIN_ARGS is a list of train_loop.py options
    pair "$variant" "$STEPS" "gpu-$variant-$rep" ${TRAIN_ARGS:-}
  done
done
sleep 3  # the agent's last drain and inflight window
kill -TERM $AGENT; wait $AGENT || true
trap - EXIT
log "summary"
"$PY" native/gpu/summarize.py "$OUT" | tee "$OUT/summary.txt"
