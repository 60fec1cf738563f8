#!/usr/bin/env bash
# One call on a lent GPU machine: set up what the image lacks, run a slice of the GPU tests,
# then (after "--") benchmarks. Logs, JUnit XML and results go to $OUT; summaries print last.
#
#   bash benchmarks/h200_session.sh NAME [pytest args] [-- bench.py args [-- bench2.py args ...]]
#   e.g. bash benchmarks/h200_session.sh ops tests/ops
#        bash benchmarks/h200_session.sh none -- benchmarks/v4_decode.py --out $OUT/v4
#        bash benchmarks/h200_session.sh none -- benchmarks/kernels.py --only moe_bw -- benchmarks/e2e_model.py ...
#
# Setup: the carried packages (.carry/, built by the project's gpu-carry tool) when present,
# else wheels in .whl/. Tests run with -v, so a run cut by its timeout still lists every test
# that finished. Knobs: NPROC (xdist workers, 8), T1 (whole pytest run, s, 400), TT (one test, s,
# 300), REACH (0: no second run of the tests T1 cut off), T3 (that run, s, 250), NPROC_REST (its
# workers, 4), RERUN (0: no serial rerun of failures), T2 (that rerun, s, 200), BENCH_TIMEOUT
# (one benchmark, s, 500), BENCH_TOTAL (all benchmarks, s, 500).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f .carry/gpu-unpack.sh ]; then
  eval "$(bash .carry/gpu-unpack.sh)"
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/pip.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt"
name=${1:-tests}; shift || true
tests=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do tests+=("$1"); shift; done; [ $# -gt 0 ] && shift
if [ ${#tests[@]} -gt 0 ]; then
  per_test=(); python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${TT:-300}")
  timeout "${T1:-400}" python3 -m pytest -m gpu -n "${NPROC:-8}" -v -rfE -p no:cacheprovider --tb=short \
    "${per_test[@]}" --junitxml="$OUT/$name.xml" "${tests[@]}" >"$OUT/$name.log" 2>&1
  echo "pytest rc=$? ($name)"
  grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/$name.log" | sort -u | tail -40
  echo "PASSED lines: $(grep -c PASSED "$OUT/$name.log")"
  # Tests the run did not reach before T1 (the card's size sets how many workers fit): run
  # them in a second pytest, so one call finishes the suite when time allows.
  if [ "${REACH:-1}" = 1 ]; then
    python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "${tests[@]}" 2>/dev/null >"$OUT/collected.txt"
    # ids as -v prints them (after the outcome, to the end of the line: ids may hold spaces); an
    # id with whitespace is passed as its test function (all its cases), which argv can carry
    mapfile -t left < <(python3 - "$OUT/collected.txt" "$OUT/$name.log" <<'PY'
import re, sys
collected = [l.strip() for l in open(sys.argv[1]) if "::" in l]
outcome = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/.*?)\s*$")
reported = {m.group(2) for l in open(sys.argv[2]) if (m := outcome.search(l))}
left = [t for t in collected if t not in reported]
print("\n".join(dict.fromkeys(t.split("[")[0] if re.search(r"\s", t) else t for t in left)))
PY
)
    rm -f "$OUT/collected.txt"
    if [ ${#left[@]} -gt 0 ] && [ -n "${left[0]}" ]; then
      timeout "${T3:-250}" python3 -m pytest -m gpu -n "${NPROC_REST:-4}" -v -rfE -p no:cacheprovider --tb=short \
        "${per_test[@]}" "${left[@]}" >"$OUT/$name-rest.log" 2>&1
      rc=$?
      echo "not reached: ${#left[@]} tests, second run rc=$rc"
      grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/$name-rest.log" | sort -u | tail -20
      grep -E "^(FAILED|ERROR) " "$OUT/$name-rest.log" >>"$OUT/$name.log"
    fi
  fi
  # Tests that failed beside many workers (out of memory on an 80 GB card, say) run again alone,
  # so the log tells a crowded card from a real failure.
  failed=$(grep -E "^(FAILED|ERROR) " "$OUT/$name.log" | awk '{print $2}' | sort -u)
  if [ -n "$failed" ] && [ "${RERUN:-1}" = 1 ]; then
    timeout "${T2:-200}" python3 -m pytest -m gpu -n 0 -v -rfE -p no:cacheprovider --tb=short \
      "${per_test[@]}" $failed >"$OUT/$name-rerun.log" 2>&1
    echo "rerun alone rc=$? ($(echo "$failed" | wc -l) tests)"
    grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/$name-rerun.log" | sort -u | tail -20
  fi
  # One line per test that reported, from every log of this slice ("[gwN] [ 5%] PASSED tests/..."
  # under xdist); a later log's outcome (the second run, the rerun) replaces an earlier one's.
  cat "$OUT/$name.log" "$OUT/$name-rest.log" "$OUT/$name-rerun.log" 2>/dev/null \
    | grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/[^ ]+" \
    | awk '{last[$2] = $1} END {for (t in last) print last[t], t}' | sort -k2 >"$OUT/${name}_outcomes.txt"
  echo "outcomes ($OUT/${name}_outcomes.txt): $(cut -d' ' -f1 "$OUT/${name}_outcomes.txt" | sort | uniq -c | xargs)"
fi
# Benchmarks: "a.py ARGS [-- b.py ARGS ...]", one after another, each in its own log (bench.txt,
# bench2.txt, ...), each under BENCH_TIMEOUT and all of them under BENCH_TOTAL seconds.
n=0; start=$SECONDS
while [ $# -gt 0 ]; do
  bench=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do bench+=("$1"); shift; done; [ $# -gt 0 ] && shift
  n=$((n + 1)); log="$OUT/bench$([ $n -gt 1 ] && echo $n).txt"
  left=$(( ${BENCH_TOTAL:-500} - (SECONDS - start) )); limit=${BENCH_TIMEOUT:-500}; [ $left -lt $limit ] && limit=$left
  if [ $limit -le 0 ]; then echo "bench $n (${bench[0]}): not run, BENCH_TOTAL spent"; continue; fi
  timeout "$limit" python3 "${bench[@]}" >"$log" 2>&1
  echo "bench $n rc=$? (${bench[*]})"; tail -n 50 "$log"
done
# The device returns at most 8 files from $OUT: past that, each folder a benchmark wrote goes
# back as one archive (FOLDER.tgz).
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  for d in "$OUT"/*/; do
    [ -d "$d" ] || continue
    tar czf "${d%/}.tgz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"
  done
  echo "results: $(find "$OUT" -type f | wc -l) files ($(ls "$OUT" | tr '\n' ' '))"
fi
