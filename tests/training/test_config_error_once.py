"""A bad config is one line, not one per rank: ``ds-megatron train`` on 4 ranks through DeepSpeed's launcher prints
the error once (the first rank of each node speaks, the others exit 2 without a word) and exits 2.

Before, each of the 4 ranks printed the same error, which for an unknown key also listed all 76 known model keys
(four lines of 1.6 KB each).  DeepSpeed's launch.py adds its own lines (it stops the other ranks and reports the
exit code); they are not ours to remove.  No torch is imported before the config is valid, so the launch is quick.
"""
import json
import os
import subprocess
import sys

import pytest

from ds_megatron.training import job as train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ERROR = "ds-megatron train: error: unknown key megatron.model.hiden_size; did you mean megatron.model.hidden_size?"


def _typo_config(tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "gpt_cpu_tp2_dp2.json")) as f:
        cfg = json.load(f)
    cfg["megatron"]["model"]["hiden_size"] = cfg["megatron"]["model"].pop("hidden_size")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_four_ranks_print_one_error_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "launch/deepspeed_cpu.sh", "4", "-m", "ds_megatron.cli", "train", "--config",
                           _typo_config(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert [line for line in output.splitlines() if "ds-megatron" in line and "error" in line] == [ERROR], output
    assert "Traceback" not in output


@pytest.mark.parametrize("env,speaks", [
    ({}, True),  # no launcher: a one-rank job
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, True),
    ({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}, False),
    ({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}, True),  # the second node's first rank: its files may differ
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, False),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, False),  # MPICH without its local variables: one node
])
def test_the_first_rank_of_each_node_speaks(tmp_path, monkeypatch, capsys, env, speaks):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(train_cli, "QUIET_RANK_EXIT_DELAY_S", 0.0)
    assert train_cli.main(["--config", _typo_config(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ([ERROR] if speaks else [])
