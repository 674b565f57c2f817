#!/usr/bin/env bash
# N ranks on this machine through the deepspeed launcher (CPU: gloo; GPU: one rank per GPU).
#
#   bash launch/deepspeed_cpu.sh N [python-entry args...]
#   bash launch/deepspeed_cpu.sh 4                         # the main job: TP=2 x DP=2 training
#   bash launch/deepspeed_cpu.sh 2 launch/probe.py         # check the launcher
#
# The entry is a script path or "-m module"; default: -m ds_megatron.cli train
# --config ds_configs/gpt_cpu_tp2_dp2.json.  MASTER_PORT: a free port unless set.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dsm_parse_args "deepspeed_cpu.sh N [python-entry args...]" "$@"
dsm_deepspeed_entry
port="${MASTER_PORT:-$(dsm_free_port)}"
# --no_local_rank: ranks read LOCAL_RANK from the environment; a --local_rank
# argument would land before the entry's own subcommand.
set -x
exec "${DSM_DEEPSPEED[@]}" --num_accelerators "$DSM_NRANKS" --master_addr 127.0.0.1 --master_port "$port" --no_local_rank \
  "${DSM_DS_ENTRY[@]}"
