"""Fixtures for the container tests: podman (skipped where it cannot run) and the CPU image.

``podman_env``: the environment every podman command here runs with; ``CONTAINERS_CONF``
comes from ``docker/podman-env.sh`` (runc, cgroupfs, file events logger, ulimits within
the sandbox's). Tests skip, saying why, where podman is not installed, ``podman info``
fails, or ``UBTREE_SKIP_DOCKER=1`` is set; a failing image build is a failure, not a skip.

``cpu_image``: ``bash docker/build.sh cpu`` (the Debian base made locally with mmdebstrap,
then docker/Dockerfile with podman's layer cache), built once per session. The times of
the build and of each step that follows are shown in the terminal summary.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from podman_helpers import CPU_IMAGE, REPO_ROOT, TIMINGS, podman, record_time  # noqa: E402

BUILD_TIMEOUT_S = 1800


def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.write_sep("-", "container test timings (tests/docker)")
        for label, seconds in TIMINGS:
            terminalreporter.write_line(f"{label}: {seconds:.0f} s")


@pytest.fixture(scope="session")
def podman_env() -> dict[str, str]:
    if os.environ.get("UBTREE_SKIP_DOCKER") == "1":
        pytest.skip("UBTREE_SKIP_DOCKER=1: container tests skipped")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed, so the container tests cannot run (on Debian, as root: "
                    "bash docker/podman-env.sh --install)")
    env = dict(os.environ)
    env.pop("CONTAINERS_CONF", None)
    conf = subprocess.run(["bash", str(REPO_ROOT / "docker" / "podman-env.sh"), "sh", "-c", 'echo "$CONTAINERS_CONF"'],
                          capture_output=True, text=True, env=env, timeout=60)
    if conf.returncode != 0 or not conf.stdout.strip():
        pytest.skip(f"docker/podman-env.sh failed, so the container tests cannot run:\n{conf.stderr}")
    env["CONTAINERS_CONF"] = conf.stdout.strip()
    info = subprocess.run(["podman", "info"], capture_output=True, text=True, env=env, timeout=120)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here (`podman info` exited with {info.returncode}): "
                    f"{info.stderr.strip()[-500:]}")
    return env


@pytest.fixture(scope="session")
def cpu_image(podman_env, tmp_path_factory) -> str:
    base_exists = podman(podman_env, "image", "exists", "localhost/ubtree-debian:bookworm", check=False).returncode == 0
    if not base_exists and (shutil.which("mmdebstrap") is None or os.geteuid() != 0):
        pytest.skip("the local Debian base image is missing and cannot be made here (needs root and mmdebstrap: "
                    "bash docker/podman-env.sh --install)")
    log = tmp_path_factory.mktemp("docker_build") / "build.log"
    started = time.monotonic()
    with log.open("w") as handle:
        proc = subprocess.run(["bash", str(REPO_ROOT / "docker" / "build.sh"), "cpu"], stdout=handle,
                              stderr=subprocess.STDOUT, env=podman_env, cwd=REPO_ROOT, timeout=BUILD_TIMEOUT_S)
    elapsed = time.monotonic() - started
    text = log.read_text()
    if proc.returncode != 0:
        pytest.fail(f"bash docker/build.sh cpu exited with {proc.returncode} after {elapsed:.0f} s:\n{text[-6000:]}")
    for line in text.splitlines():
        if line.startswith("make-debian-base: made"):
            record_time("Debian base image (mmdebstrap + podman import)", float(line.split(" in ")[-1].split()[0]))
    cached = sum(1 for line in text.splitlines() if line.startswith("--> Using cache"))
    record_time(f"CPU image build (bash docker/build.sh cpu; {cached} cached steps)", elapsed)
    return CPU_IMAGE
