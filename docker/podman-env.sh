#!/usr/bin/env bash
# Podman settings that work on the project machines (rootful podman 4.3 from Debian bookworm in a
# sandbox): the runc runtime (crun fails on the host's mixed cgroup setup), the cgroupfs manager
# and the file events logger (no systemd), and default ulimits within the sandbox's (nofile at
# most the host's hard limit, nproc at most 32768). They go into a containers.conf named by
# CONTAINERS_CONF; an already exported CONTAINERS_CONF is kept as it is.
#
#   source docker/podman-env.sh                 # export CONTAINERS_CONF in this shell
#   bash docker/podman-env.sh podman ps -a      # run one command with it
#   bash docker/podman-env.sh --install         # first apt-get install podman buildah runc mmdebstrap
#                                               # where missing (root, Debian), then check podman runs
# UBTREE_PODMAN_CONF_DIR: where the generated file goes (default /tmp/ubtree-podman).

_ubtree_podman_conf() {
    local dir="${UBTREE_PODMAN_CONF_DIR:-/tmp/ubtree-podman}" nofile nproc
    nofile="$(ulimit -Hn)"
    [[ "$nofile" == unlimited || "$nofile" -gt 1048576 ]] && nofile=1048576
    nproc="$(ulimit -Hu)"
    [[ "$nproc" == unlimited || "$nproc" -gt 32768 ]] && nproc=32768
    mkdir -p "$dir"
    cat > "$dir/containers.conf.tmp" <<EOF
# Written by docker/podman-env.sh
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    mv "$dir/containers.conf.tmp" "$dir/containers.conf"
    export CONTAINERS_CONF="$dir/containers.conf"
}

_ubtree_podman_install() {
    local missing=() tool
    for tool in podman buildah runc mmdebstrap; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
            echo "podman-env: ${missing[*]} missing and cannot apt-get install them (needs root on Debian)" >&2
            return 1
        fi
        echo "podman-env: apt-get install ${missing[*]}" >&2
        # With recommends (about 12 s): netavark, catatonit, slirp4netns, fuse-overlayfs come with them.
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            podman buildah runc mmdebstrap >/dev/null || return 1
    fi
    podman info >/dev/null || { echo "podman-env: podman info failed" >&2; return 1; }
    echo "podman-env: podman $(podman version --format '{{.Client.Version}}') ready (CONTAINERS_CONF=$CONTAINERS_CONF)" >&2
}

if [[ -z "${CONTAINERS_CONF:-}" ]]; then
    _ubtree_podman_conf
fi

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
    if [[ "${1:-}" == --install ]]; then
        shift
        _ubtree_podman_install
    fi
    if [[ $# -gt 0 ]]; then
        exec "$@"
    fi
fi
