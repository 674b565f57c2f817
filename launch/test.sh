#!/usr/bin/env bash
# Set up .venv (launch/setup.sh) and run the tests; exits with pytest's code.
#
#   bash launch/test.sh                    # the whole suite
#   bash launch/test.sh tests/parallel -x  # extra arguments go to pytest (paths replace "tests")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/setup.sh test
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# Paths given: run those; otherwise the whole tests/ tree (options still forwarded).
paths=(tests)
for arg in "$@"; do [[ "$arg" != -* && -e "${arg%%::*}" ]] && paths=() && break; done
# Two pytest workers (DSM_TEST_WORKERS; 0: one process): each test file runs whole on one of them (tests/conftest.py),
# so one file's idle waits (nodes waiting out a heartbeat limit, launchers starting) overlap another's work.
workers="${DSM_TEST_WORKERS:-2}"
xdist=()
[[ "$workers" != 0 ]] && xdist=(-n "$workers" --dist loadgroup)
set +e
python -m pytest -q "${xdist[@]}" "${paths[@]}" "$@"
code=$?
set -e
# Exit code 5 means pytest collected nothing: a wrong path or a broken tree, not a pass.
[[ $code == 5 ]] && echo "[test] pytest collected no tests (exit 5): failing" >&2
exit "$code"
