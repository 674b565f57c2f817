# Create .venv in the repo root (if missing) and install ds_megatron into it, then activate it.
#
#   source launch/setup.sh [EXTRAS]      # EXTRAS: pip extras, default "test" (e.g. "plot", "test,mpi")
#   bash launch/setup.sh [EXTRAS]        # same, without activating in your shell
#
# torch is always pinned (DSM_TORCH, default torch==2.13.0): on a machine without an
# NVIDIA GPU that resolves to the local CPU wheel, while an unpinned torch pulls a
# multi-GB CUDA build.  Everything else is installed with a constraints file that
# pins the torch actually installed, so no dependency can swap it.  Idempotent: a
# stamp per extras (keyed on pyproject.toml) skips pip when nothing changed.
# shellcheck shell=bash

_dsm_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_dsm_extras="${1:-test}"
(
  set -euo pipefail
  cd "$_dsm_root"
  log() { echo "[setup] $*"; }
  # The extra file:// indexes of some machines lack most packages; pip warns once per package.
  pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
  if [[ ! -x .venv/bin/python ]]; then
    log "creating .venv with $(python3 --version 2>&1)"
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
  stamp=".venv/.ds_megatron-setup-${_dsm_extras//[^A-Za-z0-9]/_}"
  key="$(sha256sum pyproject.toml | cut -c1-16) ${DSM_TORCH:-torch==2.13.0}"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]] && python -c "import importlib.util as u; assert all(map(u.find_spec, ('torch', 'deepspeed', 'ds_megatron')))" 2>/dev/null; then
    log ".venv is up to date for extras [$_dsm_extras]"
    exit 0
  fi
  if ! python -c "import torch" 2>/dev/null; then
    torch_spec="${DSM_TORCH:-torch==2.13.0}"
    if nvidia-smi >/dev/null 2>&1; then
      log "NVIDIA GPU found: installing $torch_spec (CUDA build, large download)"
    else
      log "no NVIDIA GPU: installing $torch_spec (CPU wheel)"
    fi
    pip_q "$torch_spec"
  fi
  torch_version="$(python -c 'from importlib.metadata import version; print(version("torch"))')"
  echo "torch==$torch_version" > .venv/constraints.txt
  log "installing ds_megatron[$_dsm_extras] (editable) with torch pinned to $torch_version"
  # PIP_CONSTRAINT also reaches the isolated build environments of source packages (deepspeed).
  PIP_CONSTRAINT="$PWD/.venv/constraints.txt" pip_q -c .venv/constraints.txt -e ".[$_dsm_extras]"
  echo "$key" > "$stamp"
  log "done: $(python -c 'import torch, deepspeed; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}")' 2>/dev/null | tail -1)"
) || { echo "[setup] failed; see the messages above" >&2; return 1 2>/dev/null || exit 1; }
# shellcheck disable=SC1091
source "$_dsm_root/.venv/bin/activate"
unset _dsm_root _dsm_extras
