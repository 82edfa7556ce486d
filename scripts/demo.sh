#!/usr/bin/env bash
# The main job: UBTree generation through vLLM (LLM(..., speculative_config={"method": "ubtree"}))
# on the embedded default target SmolLM2-135M-Instruct with the shipped drafter; prints the
# answers and vLLM's mean acceptance length. Sets up .venv on first use.
#
#   bash scripts/demo.sh                                   # default prompts
#   bash scripts/demo.sh --prompt "Explain gravity." --max-tokens 128
#   bash scripts/demo.sh --help                            # every option (examples/offline_generate.py)
#
# The HF reference decoder (exact, slow, no vLLM) is `.venv/bin/ubtree generate --check`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
drafter=checkpoints/smollm2-135m-instruct-ubtree
if [[ $# -eq 0 ]]; then
    set -- --prompt "What is the capital of France?" --prompt "Write a short poem about the sea." --max-tokens 96
fi
exec .venv/bin/python examples/offline_generate.py --drafter "$drafter" --budget 32 --beam-width 8 "$@"
