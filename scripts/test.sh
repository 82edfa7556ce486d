#!/usr/bin/env bash
# Run the tests in the project virtualenv (set up on first use by setup_env.sh).
#
#   bash scripts/test.sh                               # the whole suite (tests/), slowest 25 listed
#   bash scripts/test.sh tests/unit -k plugin          # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
if [[ $# -eq 0 ]]; then
    set -- tests --durations=25  # the whole suite names its slowest tests (CI's time budget is 90 minutes)
fi
exec .venv/bin/python -m pytest -q "$@"
