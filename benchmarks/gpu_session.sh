#!/usr/bin/env bash
# The one command a session lent a GPU machine runs (issue 11, item 7), from the repository root:
#
#     OUT=/some/folder benchmarks/gpu_session.sh
#
# It uses the machine's own python3 (which holds a CUDA torch, numpy, xxhash and rich) with the
# checkout's src/ on PYTHONPATH: nothing is installed, since such a machine reaches no package index.
# Steps, most important first, each under its own time limit so that one that hangs leaves the others
# their time and every step's output lands in $OUT as it finishes:
#   1. benchmarks/gpu_check.py --device cuda: the copy floor, the async/sync round trip on the device,
#      `ckptkeeper bench --device cuda` in one process and over a one-rank NCCL FSDP2 mesh;
#   2. the tests that need a GPU (tests/engine/test_cuda.py and the two CUDA tests beside it);
#   3. the many-tensor benchmark on the machine's CPUs at 2 gloo ranks (10 vs 10,000 tensors);
#   4. the load's floor there (benchmarks/load_floor.py: ours against a bare load, 10 vs 10,000 tensors),
#      which says how much of step 3's load ratio that machine allows any load.
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PY:-python3}
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())'
    nproc --all
    df -h /tmp | tail -1
} >"$OUT/env.txt" 2>&1

step() { # step NAME SECONDS COMMAND...: runs it, output to $OUT/NAME.log, its exit status on the last line
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "exit=$? seconds=$((SECONDS - t0))" >>"$OUT/$name.log"
    tail -1 "$OUT/$name.log"
}

step gpu_check "${GPU_CHECK_S:-200}" "$PY" benchmarks/gpu_check.py --device cuda --model-mib "${MODEL_MIB:-256}" \
    --repeats 3 --out "$OUT/gpu_check.json"
step pytest_cuda "${PYTEST_S:-90}" "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    tests/engine/test_fast_path.py tests/engine/test_bounced_loads.py tests/trust/test_default_device.py
# DCP's side of this benchmark is slow on such a machine's disk: more than 100 s at 2 ranks x 5 repeats.
for n in ${BENCH_RANKS:-2}; do
    step "bench_cpu_${n}ranks" "${BENCH_S:-150}" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
        -m ckptkeeper bench --model-mib 86 --tensors 2500 --compare-tensors 10 --repeats "${BENCH_REPEATS:-3}" --json
done
step load_floor "${FLOOR_S:-90}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/load_floor.py --repeats "${FLOOR_REPEATS:-5}"
exit 0
