# Shared by the launch scripts (sourced, not run): where the repo is, the CPU
# settings a job needs on a machine without a GPU, and how the rank count and
# the python entry are read from the command line.
# shellcheck shell=bash

DSM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The ranks import this checkout even when it is not pip-installed.
export PYTHONPATH="$DSM_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The project's interpreter without activating anything: $PYTHON if set, the active
# virtualenv's, else the repo's .venv (launch/setup.sh makes it), else python3 on PATH.
# The launchers run as modules of that interpreter, so they need not be on PATH either.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -z "${VIRTUAL_ENV:-}" && -x "$DSM_ROOT/.venv/bin/python" ]]; then
    PYTHON="$DSM_ROOT/.venv/bin/python"
  else
    PYTHON="$(command -v python3 || command -v python)"
  fi
fi
DSM_DEEPSPEED=("$PYTHON" -m deepspeed.launcher.runner)
DSM_TORCHRUN=("$PYTHON" -m torch.distributed.run)

if [[ "${DS_ACCELERATOR:-}" == cpu ]] || ! nvidia-smi >/dev/null 2>&1; then
  # CPU path (no GPU, or DS_ACCELERATOR=cpu pinning it on a GPU box): DeepSpeed's CPU
  # accelerator (gloo), all traffic on loopback.
  export DS_ACCELERATOR=cpu
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
  # glibc hands freed blocks above its moving mmap threshold back to the kernel, and every step
  # faults them in again (4-47 thousand minor faults per step at hidden 512-1024); a fixed 32 MiB
  # threshold (glibc's maximum) and no trimming keep them: 1.02-1.09x per step (docs/performance.md).
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-33554432}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-2147483647}"
fi

# The main job; launch/main.sh runs it on 4 ranks (TP=2 x DP=2).
DSM_DEFAULT_ENTRY=(-m ds_megatron.cli train --config "$DSM_ROOT/ds_configs/gpt_cpu_tp2_dp2.json")

# dsm_parse_args USAGE "$@": sets DSM_NRANKS and DSM_ENTRY (default: the main job).
dsm_parse_args() {
  local usage="$1"; shift
  if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $usage" >&2
    echo "error: the first argument must be the number of ranks, got '${1:-}'" >&2
    exit 2
  fi
  DSM_NRANKS="$1"; shift
  if [[ $# -gt 0 ]]; then DSM_ENTRY=("$@"); else DSM_ENTRY=("${DSM_DEFAULT_ENTRY[@]}"); fi
  # Split the cores between the ranks so they don't oversubscribe the box.
  local cores
  cores="$(nproc 2>/dev/null || echo 1)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / DSM_NRANKS > 0 ? cores / DSM_NRANKS : 1 ))}"
}

# A free local port, so concurrent jobs on one box don't collide.
dsm_free_port() {
  "$PYTHON" -c 'from ds_megatron.utils.dist_env import free_port; print(free_port())'
}

# The deepspeed launcher spells "python -m MODULE" as "--module MODULE".
dsm_deepspeed_entry() {
  if [[ "${DSM_ENTRY[0]}" == "-m" ]]; then DSM_DS_ENTRY=(--module "${DSM_ENTRY[@]:1}"); else DSM_DS_ENTRY=("${DSM_ENTRY[@]}"); fi
}
