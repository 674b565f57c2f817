#!/usr/bin/env bash
# N ranks on this machine through mpiexec (MPICH from `pip install 'ds-megatron[mpi]'`, or Open MPI).
#
#   bash launch/mpirun.sh N [python-entry args...]       (entry: a script path or "-m module")
#
# mpiexec exports no torch variables; ds_megatron.utils.dist_env maps
# PMI_*/MPI_LOCAL* (MPICH) or OMPI_COMM_WORLD_* (Open MPI) to them, and with
# mpi4py rank 0 picks a free MASTER_PORT and broadcasts it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dsm_parse_args "mpirun.sh N [python-entry args...]" "$@"
if ! command -v mpiexec >/dev/null; then
  echo "error: mpiexec not found; pip install 'ds-megatron[mpi]' (mpi4py + mpich) or install Open MPI" >&2
  exit 2
fi
extra=()
if mpiexec --version 2>&1 | grep -q "Open MPI"; then
  # Open MPI refuses root and more ranks than cores unless told; -x forwards our settings.
  [[ "$(id -u)" == 0 ]] && extra+=(--allow-run-as-root)
  extra+=(--oversubscribe -x PYTHONPATH -x OMP_NUM_THREADS -x DS_ACCELERATOR -x GLOO_SOCKET_IFNAME)
fi
set -x
exec mpiexec "${extra[@]}" -n "$DSM_NRANKS" "$PYTHON" "${DSM_ENTRY[@]}"
