#!/usr/bin/env bash
# DeepSpeed's own pipeline tests, run twice: as they are (deepspeed.initialize) and with every
# deepspeed.initialize call going through ds_megatron.initialize; every test that passes the first way
# must pass the second.  Not part of the suite: it needs a DeepSpeed source checkout (docs/testing.md).
#
#   bash launch/ds_pipe_tests.sh /path/to/DeepSpeed            # tests/unit/pipe and tests/unit/runtime/pipe
#   bash launch/ds_pipe_tests.sh /path/to/DeepSpeed -k Dynamic # extra arguments go to both pytest runs
#
# The checkout gives the tests only: they are copied out of it, so the installed deepspeed is the one tested
# (DeepSpeed's tests/conftest.py puts the checkout's root on sys.path ahead of site-packages).  The patch is a
# sitecustomize.py on PYTHONPATH, so it also reaches the ranks DeepSpeed's DistributedTest starts (forkserver/spawn).
# Exits 1 when a test passes with deepspeed.initialize but not through ds_megatron.initialize.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [[ $# -lt 1 || ! -d "$1/tests/unit/pipe" || ! -d "$1/tests/unit/runtime/pipe" ]]; then
  echo "usage: bash launch/ds_pipe_tests.sh <deepspeed-source-dir> [pytest args]: the directory must hold" \
       "tests/unit/pipe and tests/unit/runtime/pipe (a DeepSpeed checkout of the installed version)" >&2
  exit 2
fi
src="$(cd "$1" && pwd)"; shift
# DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE (else NUMA nodes: 1 here), and DistributedTest
# skips a test that needs more ranks than devices: 4 lets its 2- and 4-rank tests run.
[[ "${DS_ACCELERATOR:-}" == cpu ]] && export LOCAL_SIZE="${LOCAL_SIZE:-4}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$src/tests" "$work/tests"
mkdir "$work/patch"
cat > "$work/patch/sitecustomize.py" <<'EOF'
"""deepspeed.initialize -> ds_megatron.initialize in this process and every process it starts (written by
launch/ds_pipe_tests.sh).  ds_megatron.initialize calls deepspeed.initialize underneath: that inner call runs
DeepSpeed's own.  Each redirected call appends this process's id to $DSM_PATCH_LOG."""
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading


def _patch(deepspeed):
    original, inside = deepspeed.initialize, threading.local()

    def initialize(*args, **kwargs):
        if getattr(inside, "active", False):
            return original(*args, **kwargs)
        import ds_megatron
        arguments = inspect.signature(original).bind(*args, **kwargs).arguments
        with open(os.environ["DSM_PATCH_LOG"], "a") as log:
            log.write(f"{os.getpid()}\n")
        inside.active = True
        try:
            return ds_megatron.initialize(**arguments)
        finally:
            inside.active = False
    deepspeed.initialize = initialize


class _OnDeepSpeedImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _OnDeepSpeedImport())
EOF

# run NAME PYTHONPATH-PREFIX PYTEST-ARGS...: pytest on the copied tests, its log without colour (DeepSpeed's
# conftest turns it on) in $work/NAME.log and its "OUTCOME node-id" lines in $work/NAME.outcomes.
run() {
  local name="$1" prefix="$2"
  shift 2
  echo "== $name: $("$PYTHON" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>/dev/null)"
  (cd "$work/tests" && PYTHONPATH="$prefix$PYTHONPATH" DSM_PATCH_LOG="$work/calls" \
     "$PYTHON" -m pytest -p no:cacheprovider -rA -q "$@" 2>&1 | sed 's/\x1b\[[0-9;]*m//g' > "$work/$name.log") || true
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$work/$name.log" | sort > "$work/$name.outcomes" || true
  grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$work/$name.log" | tail -1 || tail -20 "$work/$name.log"
  grep -E '^(FAILED|ERROR|SKIPPED) ' "$work/$name.outcomes" | cut -c1-220 || true
}
passed() { sed -n 's/^PASSED //p' "$work/$1.outcomes"; }
: > "$work/calls"
run deepspeed.initialize "" unit/pipe unit/runtime/pipe "$@"
[[ -s "$work/calls" ]] && { echo "the patch ran without being asked to" >&2; exit 1; }
run ds_megatron.initialize "$work/patch:" unit/pipe unit/runtime/pipe "$@"
echo "== calls that went through ds_megatron.initialize: $(wc -l < "$work/calls")" \
     "in $(sort -u "$work/calls" | wc -l) processes"
mapfile -t lost < <(comm -23 <(passed deepspeed.initialize) <(passed ds_megatron.initialize))
if [[ ${#lost[@]} -gt 0 ]]; then
  # Some of DeepSpeed's tests fail now and then either way (TestPipeModuleSequential with torch.compile: a rank
  # aborts at exit): what passed the first way gets a second try before it counts as broken.
  run second-try "$work/patch:" "${lost[@]}"
  mapfile -t lost < <(comm -23 <(printf '%s\n' "${lost[@]}" | sort) <(passed second-try))
fi
if [[ ${#lost[@]} -gt 0 ]]; then
  echo "== passed with deepspeed.initialize, not through ds_megatron.initialize (twice):"; printf '%s\n' "${lost[@]}"
  echo "== its log:"; tail -150 "$work/second-try.log"
  exit 1
fi
echo "== every test that passed with deepspeed.initialize passed through ds_megatron.initialize"
