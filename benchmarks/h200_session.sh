#!/usr/bin/env bash
# One call on the lent H200: install what the image lacks (carried wheels in .whl/), run the GPU
# tests, then the kernel benchmark. Logs and results go to $OUT; the table prints last.
#   bash benchmarks/h200_session.sh [pytest selection] -- [benchmarks/kernels.py args]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/pip.txt" 2>&1
tests=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do tests+=("$1"); shift; done; [ $# -gt 0 ] && shift
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt"
if [ ${#tests[@]} -gt 0 ]; then
  timeout 250 python3 -m pytest -m gpu -n 8 -v -rf -p no:cacheprovider -p no:logging "${tests[@]}" >"$OUT/tests.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3
  grep -E "FAILED|ERROR" "$OUT/tests.txt" | sort -u | head -40
fi
if [ $# -gt 0 ] || [ ${#tests[@]} -eq 0 ]; then
  timeout ${BENCH_TIMEOUT:-500} python3 benchmarks/kernels.py --out "$OUT" "$@" >"$OUT/bench.txt" 2>&1
  echo "bench rc=$?"; tail -n 50 "$OUT/bench.txt"
fi
