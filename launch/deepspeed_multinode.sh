#!/usr/bin/env bash
# Several nodes through the deepspeed launcher and a hostfile (see launch/hostfile.example).
#
#   bash launch/deepspeed_multinode.sh HOSTFILE [python-entry args...]
#
# The rank count is the sum of the hostfile's slots.  Run it on the first host;
# MASTER_ADDR defaults to that host's name, MASTER_PORT to a free port here.
# A hostfile with a single "localhost slots=N" line runs locally (no ssh).
# DS_LAUNCHER picks DeepSpeed's multi-node runner (default pdsh, over ssh; also openmpi, mpich,
# impi, slurm, mvapich) and DS_LAUNCHER_ARGS is handed to it, e.g. on an MPICH cluster:
#   DS_LAUNCHER=mpich bash launch/deepspeed_multinode.sh hostfile
# DS_LAUNCHER=ssh needs no pdsh: launch/ssh_runner.py reaches each node with plain OpenSSH and starts
# DeepSpeed's per-node mode there (deepspeed --no_ssh --node_rank I); DS_LAUNCHER_ARGS are ssh options.
# (tests/test_multinode.py runs two "nodes" on one machine with DS_LAUNCHER_ARGS="-launcher fork").
# DS_SSH_PORT, DS_INCLUDE and DS_EXCLUDE become deepspeed's --ssh_port, --include and --exclude, e.g.
#   DS_SSH_PORT=2222 DS_EXCLUDE=node3 bash launch/deepspeed_multinode.sh hostfile
# (tests/test_nodes.py runs real nodes over ssh with all three).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
usage="deepspeed_multinode.sh HOSTFILE [python-entry args...]"
hostfile="${1:?usage: $usage}"; shift
if [[ ! -f "$hostfile" ]]; then echo "error: hostfile '$hostfile' not found; see launch/hostfile.example" >&2; exit 2; fi
slots="$(awk '!/^[[:space:]]*(#|$)/ { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { sub("slots=", "", $i); n += $i } } END { print n + 0 }' "$hostfile")"
first_host="$(awk '!/^[[:space:]]*(#|$)/ { print $1; exit }' "$hostfile")"
if [[ "$slots" -lt 1 ]]; then echo "error: hostfile '$hostfile' gives no slots; write lines like 'node1 slots=4'" >&2; exit 2; fi
dsm_parse_args "$usage" "$slots" "$@"
dsm_deepspeed_entry
if [[ "$first_host" == localhost ]]; then addr=127.0.0.1; else addr="${MASTER_ADDR:-$first_host}"; fi
port="${MASTER_PORT:-$(dsm_free_port)}"
extra=()
# The runner looks mpirun up on PATH: the interpreter's bin first (an MPI wheel puts its mpirun there).
[[ -n "${DS_LAUNCHER:-}" && "$DS_LAUNCHER" != ssh ]] && extra+=(--launcher "$DS_LAUNCHER") && export PATH="$(dirname "$PYTHON"):$PATH"
[[ -n "${DS_LAUNCHER_ARGS:-}" ]] && extra+=(--launcher_args "$DS_LAUNCHER_ARGS")
[[ -n "${DS_SSH_PORT:-}" ]] && extra+=(--ssh_port "$DS_SSH_PORT")
[[ -n "${DS_INCLUDE:-}" ]] && extra+=(--include "$DS_INCLUDE")
[[ -n "${DS_EXCLUDE:-}" ]] && extra+=(--exclude "$DS_EXCLUDE")
nhosts="$(awk '!/^[[:space:]]*(#|$)/ { n++ } END { print n + 0 }' "$hostfile")"
# One host runs locally; DeepSpeed would still insist on ssh to it otherwise.
# The MPI runners reach the hosts through mpirun, not DeepSpeed's ssh check.
[[ "$nhosts" == 1 || "${DS_LAUNCHER:-pdsh}" != pdsh ]] && extra+=(--no_ssh_check)
runner=("${DSM_DEEPSPEED[@]}")
[[ "${DS_LAUNCHER:-}" == ssh && "$nhosts" != 1 ]] && runner=("$PYTHON" "$DSM_ROOT/launch/ssh_runner.py")
set -x
exec "${runner[@]}" --hostfile "$hostfile" --master_addr "$addr" --master_port "$port" --no_local_rank "${extra[@]}" \
  "${DSM_DS_ENTRY[@]}"
