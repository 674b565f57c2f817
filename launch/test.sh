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
set +e
python -m pytest -q "${paths[@]}" "$@"
code=$?
set -e
# Exit code 5 means pytest collected nothing: a wrong path or a broken tree, not a pass.
[[ $code == 5 ]] && echo "[test] pytest collected no tests (exit 5): failing" >&2
exit "$code"
