#!/usr/bin/env bash
# N ranks on this machine through torchrun.
#
#   bash launch/torchrun.sh N [python-entry args...]     (entry: a script path or "-m module")
#
# Default entry: the main job (-m ds_megatron.cli train --config ds_configs/gpt_cpu_tp2_dp2.json).
# MASTER_PORT: a free port unless set.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dsm_parse_args "torchrun.sh N [python-entry args...]" "$@"
port="${MASTER_PORT:-$(dsm_free_port)}"
set -x
exec "${DSM_TORCHRUN[@]}" --nproc_per_node "$DSM_NRANKS" --master_addr 127.0.0.1 --master_port "$port" "${DSM_ENTRY[@]}"
