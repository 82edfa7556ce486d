#!/usr/bin/env bash
# Make a Debian base image locally, for machines with podman but no container registry:
# Debian's packages, unpacked by mmdebstrap (minbase variant plus ca-certificates), imported
# into podman's local storage. Skipped when the image already exists (--force remakes it).
#
#   bash docker/make-debian-base.sh                      # localhost/ubtree-debian:bookworm
#   bash docker/make-debian-base.sh --tag localhost/debian:bookworm --force
#
# bookworm's python3 is 3.11, the CPython of the machine's torch 2.13.0+cpu wheel; the
# Dockerfiles install it (and python3-venv) from Debian on a base without python3.
# The apt options `Check-Valid-Until false` and `Check-Date false` stay in the image
# (/etc/apt/apt.conf.d/99mmdebstrap): the project machines' Debian mirror serves a dated
# snapshot whose Release files are past their Valid-Until date. Needs root and mmdebstrap.
# Environment: DEBIAN_SUITE (bookworm), DEBIAN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source docker/podman-env.sh

tag="localhost/ubtree-debian:bookworm" force=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "make-debian-base: unknown option $1" >&2; exit 2 ;;
    esac
done

if [[ $force == 0 ]] && podman image exists "$tag"; then
    echo "make-debian-base: $tag exists" >&2
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS
mmdebstrap --quiet --variant=minbase --include=ca-certificates \
    --aptopt='Acquire::Check-Valid-Until "false"' --aptopt='Acquire::Check-Date "false"' \
    "${DEBIAN_SUITE:-bookworm}" "$work/rootfs.tar" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
podman import --quiet --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
    "$work/rootfs.tar" "$tag" >/dev/null
echo "make-debian-base: made $tag in $((SECONDS - started)) s" >&2
