#!/usr/bin/env bash
# Set up .venv (launch/setup.sh) and run the main job: 4-rank TP=2 x DP=2 GPT training
# through the deepspeed launcher (ds_configs/gpt_cpu_tp2_dp2.json).  Extra arguments
# replace the default entry, e.g.  bash launch/main.sh launch/probe.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/setup.sh plot
exec bash launch/deepspeed_cpu.sh 4 "$@"
