#!/usr/bin/env bash
# The GPU checks in one command, for a lent machine whose carry is unpacked (ci/gpu/README.md):
# install the carried vLLM + kvstack's series, then check_layout.py (side by side),
# check_streaming.py and check_scratch.py, each under its own time limit, so that what ran is reported even when the
# call's time runs out. Logs go to $OUT (or --out DIR) as they are written; the per-run logs of
# both checks are packed into one tarball at the end.
#
#   ci/gpu/run_checks.sh [--out DIR] [--layout-s S] [--streaming-s S] [--scratch-s S]
#                        [--skip-layout] [--skip-streaming] [--skip-scratch] [--no-install]
#                        [--models M,...]
#
# --no-install: the venv of an earlier call on the same (warm) machine, import-checked only.
# --models: check_layout's tiny models (default llama,llama4,qwen3next).
#
# Exit status: 0 when every check that ran passed, else the first failing step's.
set -u
out=${OUT:-build/gpu-out}
layout_s=240
streaming_s=330
scratch_s=200
run_layout=1
run_streaming=1
run_scratch=1
install=1
models=llama,llama4,qwen3next
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --layout-s) layout_s=$2; shift 2 ;;
    --streaming-s) streaming_s=$2; shift 2 ;;
    --skip-layout) run_layout=0; shift ;;
    --skip-streaming) run_streaming=0; shift ;;
    --scratch-s) scratch_s=$2; shift 2 ;;
    --skip-scratch) run_scratch=0; shift ;;
    --no-install) install=0; shift ;;
    --models) models=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_checks.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export KVSTACK_BASE=${KVSTACK_BASE:-0.25} PYTHONUNBUFFERED=1  # the base carry.py packs
py=/tmp/kvstack-venv/bin/python
status=0
step() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/steps.log"; }

step "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
start=$(date +%s)
if [ "$install" = 1 ]; then
  step install
  python3 ci/gpu/carry.py install > "$out/install.log" 2>&1 || status=$?
else
  step "no install: import check of $py"
  "$py" -c "import vllm.entrypoints.llm, vllm.v1.engine.core; print('import ok')" \
    > "$out/install.log" 2>&1 || status=$?
fi
step "install exit $status after $(( $(date +%s) - start )) s"
tail -5 "$out/install.log"
if [ "$status" -ne 0 ]; then tail -40 "$out/install.log"; exit "$status"; fi

if [ "$run_layout" = 1 ]; then
  step "check_layout (limit ${layout_s} s)"
  start=$(date +%s)
  # FLASHINFER is not carried (carry.py DEFAULT_SKIP): the two backends vLLM has built in
  timeout "$layout_s" "$py" ci/gpu/check_layout.py --backends FLASH_ATTN,TRITON_ATTN \
    --models "$models" --jobs 6 \
    > "$out/check_layout.log" 2>&1
  rc=$?
  step "check_layout exit $rc after $(( $(date +%s) - start )) s"
  cat "$out/check_layout.log"
  [ "$status" -eq 0 ] && status=$rc
fi

if [ "$run_streaming" = 1 ]; then
  step "check_streaming (limit ${streaming_s} s)"
  start=$(date +%s)
  timeout "$streaming_s" "$py" ci/gpu/check_streaming.py --timeout $(( streaming_s / 2 )) \
    > "$out/check_streaming.log" 2>&1
  rc=$?
  step "check_streaming exit $rc after $(( $(date +%s) - start )) s"
  cat "$out/check_streaming.log"
  [ "$status" -eq 0 ] && status=$rc
fi

if [ "$run_scratch" = 1 ]; then
  step "check_scratch (limit ${scratch_s} s)"
  start=$(date +%s)
  # three engines in turn (native, streaming, control), each alone on the device
  timeout "$scratch_s" "$py" ci/gpu/check_scratch.py --timeout $(( scratch_s / 3 )) \
    > "$out/check_scratch.log" 2>&1
  rc=$?
  step "check_scratch exit $rc after $(( $(date +%s) - start )) s"
  cat "$out/check_scratch.log"
  [ "$status" -eq 0 ] && status=$rc
fi

# the per-run logs (engine starts, vLLM's KV-cache sizes, failures) in one file
tar -czf "$out/run-logs.tgz" --ignore-failed-read \
  $(ls -d build/gpu-check/*.log build/gpu-check/*.json build/gpu-check-streaming/*.log \
      build/gpu-check-streaming/*.json build/gpu-check-scratch/*.log \
      build/gpu-check-scratch/*.json 2>/dev/null) 2>/dev/null
step "done, exit $status"
exit "$status"
