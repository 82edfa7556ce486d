#!/usr/bin/env bash
# Build the CPU or GPU image with podman on a machine without a container registry (what CI
# does): the base is a Debian image made locally (docker/make-debian-base.sh), the build context
# is the repository root, layers are cached in podman's storage.
#
#   bash docker/build.sh cpu                    # ubtree-vllm:cpu on localhost/ubtree-debian:bookworm
#   bash docker/build.sh gpu                    # ubtree-vllm:gpu, vllm==0.32.0 from PyPI on the same base
#   bash docker/build.sh cpu --base python:3.11-slim-bookworm --tag my/ubtree:cpu -- --no-cache
#                                               # after --: more `podman build` options
#
# Before building it stages into the (git-ignored) build-context folders:
#   docker/wheels/  the torch 2.13.0+cpu wheel for CPython 3.11 from pip's find-links folders
#                   (PIP_FIND_LINKS, `pip config get global.find-links`) or UBTREE_TORCH_WHEEL;
#                   with it, TORCH_INDEX_URL is left empty (download.pytorch.org is not reachable
#                   on the project machines). Hard-linked where possible.
#   docker/ca/      the host's locally added CA certificates (/usr/local/share/ca-certificates/*.crt,
#                   or UBTREE_CA_DIR), which HTTPS through an intercepting proxy needs inside the build.
# Prints the build's wall time in seconds as the last line of stderr ("build.sh: ... in N s").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source docker/podman-env.sh

kind="${1:-}"
[[ "$kind" == cpu || "$kind" == gpu ]] || { echo "usage: build.sh cpu|gpu [--base IMAGE] [--tag TAG] [-- podman build options]" >&2; exit 2; }
shift
base="" tag="ubtree-vllm:$kind"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --base) base="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "build.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$base" ]]; then
    base="localhost/ubtree-debian:bookworm"
    bash docker/make-debian-base.sh --tag "$base"
fi

build_args=(--build-arg "BASE_IMAGE=$base")

# The Containerfiles COPY / bind-mount these folders, so they must exist even when empty.
mkdir -p docker/ca docker/wheels
# CA certificates: replace what a previous build staged.
find docker/ca -mindepth 1 ! -name .gitignore -delete
ca_dir="${UBTREE_CA_DIR:-/usr/local/share/ca-certificates}"
if [[ -d "$ca_dir" ]]; then
    find "$ca_dir" -name '*.crt' -type f -exec cp {} docker/ca/ \;
fi

if [[ "$kind" == cpu ]]; then
    wheel="${UBTREE_TORCH_WHEEL:-}"
    if [[ -z "$wheel" ]]; then
        links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
        for dir in $links; do
            dir="${dir#file://}"
            for candidate in "$dir"/torch-2.13.0+cpu-cp311-cp311-*.whl; do
                [[ -f "$candidate" ]] && { wheel="$candidate"; break 2; }
            done
        done
    fi
    if [[ -n "$wheel" ]]; then
        staged="docker/wheels/$(basename "$wheel")"
        if [[ ! "$staged" -ef "$wheel" ]]; then
            find docker/wheels -mindepth 1 -name 'torch-*.whl' -delete
            ln "$wheel" "$staged" 2>/dev/null || cp "$wheel" "$staged"
        fi
        build_args+=(--build-arg "TORCH_INDEX_URL=")
        echo "build.sh: torch from $wheel" >&2
    fi
    file=docker/Dockerfile
else
    file=docker/Dockerfile.gpu
fi

started=$SECONDS
podman build --layers --ignorefile docker/.containerignore -f "$file" "${build_args[@]}" -t "$tag" "$@" .
echo "build.sh: built $tag ($file on $base) in $((SECONDS - started)) s" >&2
