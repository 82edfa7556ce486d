#!/usr/bin/env bash
# One device call: the staged environment, then each argument as a shell command line (usually
# `bash scripts/gpu/train_smollm2.sh <phase>` with its selectors in front, a `timeout` around it), one
# after the other whatever their exit codes, with the tail of each command's output and the seconds spent
# printed; at the end the session's records (runs/records.jsonl, kept between calls of one warm machine)
# and the calls' full log (runs/all.log, gzipped) are copied to $OUT.
#   UBTREE_COMMIT=$(git rev-parse --short HEAD) must be passed in (the device copy has no .git).
# Example (from the local checkout, through the device tool):
#   UBTREE_COMMIT=abc1234 bash scripts/gpu/run_phases.sh \
#     "bash scripts/gpu/train_smollm2.sh install prepare" \
#     "TESTS_K='tree_attention or lookup' timeout 300 bash scripts/gpu/train_smollm2.sh tests"
set -uo pipefail
: "${UBTREE_COMMIT:?pass UBTREE_COMMIT=<the local HEAD>: records name the commit, and the device copy has no .git}"
source /tmp/gpu-env.sh || { echo "run_phases: /tmp/gpu-env.sh missing: stage the machine first"; exit 3; }
ln -sfn /tmp/gpu-extra/data .gpudata
export UBTREE_COMMIT RECORDS=runs/records.jsonl UBTREE_CACHE_DIR=/tmp/ubcache
mkdir -p runs "$OUT"
start=$(date +%s)
for step in "$@"; do
  echo "=== $(date +%T) $step"
  ( eval "$step" ) > runs/step.log 2>&1
  rc=$?
  tail -c 2500 runs/step.log
  cat runs/step.log >> runs/all.log
  echo "=== rc=$rc after $(( $(date +%s) - start )) s"
done
[ -f runs/records.jsonl ] && cp runs/records.jsonl "$OUT/records.jsonl"
gzip -c runs/all.log > "$OUT/all.log.gz"
exit 0
