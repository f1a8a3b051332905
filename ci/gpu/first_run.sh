#!/usr/bin/env bash
# A lent GPU's first job, in one command (issue 32): the torch-only floor bench
# (bench/streaming_gpu.py), then the checks that need vLLM (run_checks.sh: install the carried vLLM
# + kvstack's series, check_layout.py, check_streaming.py), each under its own time limit, so the
# whole fits one `run` call of 10 minutes. Every figure and log goes under one folder ($OUT, or
# --out), and each step ends with one summary line: "STEP <name> exit <rc> in <s> s: <what>".
#
#   ci/gpu/first_run.sh [--out DIR] [--bench-s S] [--layout-s S] [--streaming-s S]
#                       [--skip-bench] [--skip-checks] [--bench-args "ARGS"]
#   ci/gpu/first_run.sh --dry-run [--cpu]     (here: the session's plan, nothing runs on a GPU)
#
# On the GPU machine it is the last call of a session, after the carry's unpack calls (carry.py
# pack prints them; the machine goes back after ~30 s idle, so each call follows the previous one
# at once): timeout_s 600. The floor bench needs nothing carried; the checks need the carry.
#
# --dry-run: every `run` call of the session in order (carry folder, its MiB with the working tree,
#   checked against the tool's 64 MiB less a margin, command, timeout), the expected device time of
#   each from the H200 run of 2026-11-26 and the total against the session's budget; with --cpu it
#   also runs the CPU variant of each step (the floor bench --device cpu --tiny, check_layout.py
#   --backends CPU on the tiny llama, check_streaming.py --device cpu at a short prompt) into --out.
#   CI runs `--dry-run` (tests/tooling/test_gpu_first_run.py); the CPU variants at full size are
#   tests of their own (test_streaming_gpu_bench.py, test_gpu_check_script.py,
#   test_gpu_check_streaming_script.py).
#
# Exit status: 0 every step that ran passed; else the first failing step's; 2 bad usage; --dry-run:
# 1 when a call would carry too much or the plan overruns the budget.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-$root/build/gpu-first-run}
# limits from the H200 runs of 2026-11-27 (bench 33 s, install 68 s, check_layout 141 s,
# check_streaming 201 s) and 2026-11-30 (bench 50 s with a 26 s tier allocation since cut to 7 s,
# install 64 s, check_layout 122 s, check_streaming 164 s), with room for the bench's connector
# variant (~10 s more): 75 + ~70 + 165 + 270 s fit one 600 s call
bench_s=75
layout_s=165
streaming_s=270
run_bench=1
run_checks=1
dry_run=0
cpu=0
# 128K and 1M tokens, pages in order, one decode batch: the figures docs/streaming-gpu.md asks for;
# "connector": the StreamingConnector's own windowed path timed beside the bench's pipeline
bench_args="--contexts 128K,1M --page-order contiguous --decode-batch 1 --decode stream,connector --reps 2"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --bench-s) bench_s=$2; shift 2 ;;
    --layout-s) layout_s=$2; shift 2 ;;
    --streaming-s) streaming_s=$2; shift 2 ;;
    --skip-bench) run_bench=0; shift ;;
    --skip-checks) run_checks=0; shift ;;
    --bench-args) bench_args=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --cpu) cpu=1; shift ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "first_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$cpu" = 1 ] && [ "$dry_run" = 0 ]; then
  echo "first_run.sh: --cpu goes with --dry-run (see --help)" >&2; exit 2
fi
mkdir -p "$out"
cd "$root" || exit 2

summary() {  # STEP name rc seconds what
  echo "STEP $1 exit $2 in $3 s: $4" | tee -a "$out/summary.log"
}

if [ "$dry_run" = 1 ]; then
  python3 ci/gpu/carry.py plan --bench-s "$bench_s" --layout-s "$layout_s" \
    --streaming-s "$streaming_s" --bench-args "$bench_args"
  status=$?
  if [ "$cpu" = 1 ]; then
    py=${PYTHON:-$root/.venv/bin/python}
    start=$(date +%s)
    "$py" bench/streaming_gpu.py --device cpu --tiny > "$out/floor-bench-cpu.log" 2>&1
    rc=$?
    summary floor-bench-cpu "$rc" $(( $(date +%s) - start )) "$(grep '^RESULT' "$out/floor-bench-cpu.log" | cut -c1-160)"
    [ "$status" -eq 0 ] && status=$rc
    start=$(date +%s)
    "$py" ci/gpu/check_layout.py --backends CPU --models llama > "$out/check_layout-cpu.log" 2>&1
    rc=$?
    summary check_layout-cpu "$rc" $(( $(date +%s) - start )) "$(tail -1 "$out/check_layout-cpu.log" | cut -c1-160)"
    [ "$status" -eq 0 ] && status=$rc
    start=$(date +%s)
    "$py" ci/gpu/check_streaming.py --device cpu --long-tokens 1024 > "$out/check_streaming-cpu.log" 2>&1
    rc=$?
    summary check_streaming-cpu "$rc" $(( $(date +%s) - start )) "$(tail -1 "$out/check_streaming-cpu.log" | cut -c1-160)"
    [ "$status" -eq 0 ] && status=$rc
  fi
  exit "$status"
fi

status=0
echo "== $(date -u +%FT%TZ) device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)" \
  | tee -a "$out/summary.log"
if [ "$run_bench" = 1 ]; then
  start=$(date +%s)
  # torch only (the machine's python3): no carry needed; what it finished is in the log even when
  # the limit cuts it
  # shellcheck disable=SC2086
  timeout "$bench_s" python3 bench/streaming_gpu.py $bench_args > "$out/floor-bench.log" 2>&1
  rc=$?
  line=$(grep '^RESULT' "$out/floor-bench.log" | tail -1)
  [ -n "$line" ] || line="no RESULT line (see floor-bench.log); last: $(tail -1 "$out/floor-bench.log")"
  summary floor-bench "$rc" $(( $(date +%s) - start )) "$line"
  [ "$status" -eq 0 ] && status=$rc
fi
if [ "$run_checks" = 1 ]; then
  start=$(date +%s)
  # check_scratch.py is a call of its own (carry.py plan: call 8), on the same warm machine
  OUT="$out" bash ci/gpu/run_checks.sh --out "$out" --layout-s "$layout_s" \
    --streaming-s "$streaming_s" --skip-scratch > "$out/run_checks.log" 2>&1
  rc=$?
  summary checks "$rc" $(( $(date +%s) - start )) \
    "$(grep -h '^RESULT' "$out/check_layout.log" "$out/check_streaming.log" 2>/dev/null | cut -c1-200 | tr '\n' ' ')"
  [ "$status" -eq 0 ] && status=$rc
fi
echo "== done, exit $status (logs and figures in $out)" | tee -a "$out/summary.log"
exit "$status"
