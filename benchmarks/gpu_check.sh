#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA machine with torch and no network:
#   1. the suite's CUDA tests (pytest -m cuda), the package's own controller;
#   2. benchmarks/gpu_bench.py (data path against pinned copies, overhead on cuda);
#   3. per SGLang release: its CUDA tests (SGLang's real controller on the GPU, instrumented),
#      then benchmarks/sglang_gpu.py: the demo on the GPU per io backend (summary JSON) and,
#      for the first release named (default 0.5.23, then 0.5.10), the bench's sglang section.
# SKIP_BASE=1 runs step 3 alone.
#
# Prepare here with `.venv/bin/python benchmarks/gpu_bundle.py` (writes .gpu/), then run from
# the repository root there:  OUT=/some/dir bash benchmarks/gpu_check.sh [RELEASE ...]
# Each step has its own time limit, cut to what is left of DEADLINE_S (default 540 s, under a
# device call's limit) from the start, and its own log; a failed step is reported and the next
# one runs. The logs are packed into $OUT/gpu-check.tar.gz after every step, so what a run
# cut short leaves comes back. The last lines say which steps passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hicache-gpu-check}
LOGS=${LOGS:-/tmp/hicache-gpu-logs}
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-.gpu}
SITE=${SITE:-/tmp/gpu-site}
RELEASES=("$@")
[ ${#RELEASES[@]} -eq 0 ] && RELEASES=(0.5.23 0.5.10)
mkdir -p "$OUT" "$LOGS" "$SITE"
export PY BUNDLE SITE
export RELEASE_LIST="${RELEASES[*]}"
export PYTHONUNBUFFERED=1 SGLANG_ENABLE_JIT_DEEPGEMM=0 HICACHE_OBS_REQUIRE_EXTENSIONS=
declare -a RESULTS=()
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-540}

pack() {  # the results so far, and every log, into $OUT (after every step)
    printf '%s\n' "${RESULTS[@]}" >"$LOGS/results.txt"
    tar -czf "$OUT/gpu-check.tar.gz" -C "$LOGS" .
}

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND with its output in $LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    local t=$(date +%s)
    local left=$((T0 + DEADLINE_S - t))
    if [ "$left" -le 5 ]; then
        RESULTS+=("$name not run: the deadline (${DEADLINE_S}s) is spent")
        echo "-- $name: not run, the deadline is spent"
        pack
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $(date +%T) +$((t - T0))s $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    RESULTS+=("$name rc=$rc $(( $(date +%s) - t ))s")
    echo "-- $name: rc=$rc in $(( $(date +%s) - t ))s"
    pack
}

machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
    nproc
}

wheels_of() {  # the wheel files a list names, one per line (none for an empty list)
    local w
    while IFS= read -r w; do
        [ -n "$w" ] && printf '%s\n' "$BUNDLE/wheels/$w"
    done <"$1"
}

install_bundle() {
    local -a wheels
    rm -rf "${SITE:?}"/*  # pip --target keeps what is there: start clean
    mapfile -t wheels < <(wheels_of "$BUNDLE/common.txt")
    if [ ${#wheels[@]} -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE/common" "${wheels[@]}" || return 1
    fi
    for r in $RELEASE_LIST; do
        mkdir -p "$SITE/$r"
        tar -xJf "$BUNDLE/$r/site.tar.xz" -C "$SITE/$r" || return 1
        mapfile -t wheels < <(wheels_of "$BUNDLE/$r.txt")
        if [ ${#wheels[@]} -gt 0 ]; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE/$r" "${wheels[@]}" || return 1
        fi
    done
    # the package itself, editable, with its C extensions where this machine builds them
    PYTHONPATH="$SITE/common" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    PYTHONPATH="$SITE/common" "$PY" -c 'import hicache_obs._native as n; print("extensions:", n.choose()[0])'
}

export -f machine wheels_of install_bundle
step machine 60 bash -c machine
step install 180 bash -c install_bundle
export PYTHONPATH="$SITE/common"
if [ -z "${SKIP_BASE:-}" ]; then  # SKIP_BASE=1: the SGLang steps alone
    step cuda-tests 200 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests -rs
    step gpu-bench 200 bash -c "'$PY' benchmarks/gpu_bench.py > '$LOGS/gpu-bench.json'"
fi
for r in "${RELEASES[@]}"; do
    export PYTHONPATH="$SITE/$r:$SITE/common"
    step "sglang-$r-tests" 200 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/integrations/sglang \
        --ignore=tests/integrations/sglang/test_kernels.py -rs
    bench=""
    [ "$r" = "${RELEASES[0]}" ] && bench=--bench  # the bench on the first release only (the current one)
    step "sglang-$r-runs" 200 "$PY" benchmarks/sglang_gpu.py --out "$LOGS/sglang-$r" $bench
done
unset PYTHONPATH
echo "== results ($(( $(date +%s) - T0 ))s in all)"
printf '%s\n' "${RESULTS[@]}"
