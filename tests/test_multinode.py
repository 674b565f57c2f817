"""Two simulated nodes on one machine: two ``torchrun --nnodes 2 --node_rank 0|1`` launches meet at one
rendezvous (127.0.0.1), or the ``deepspeed`` launcher reads a two-entry hostfile and starts both "nodes"
through its MPICH runner (hydra's fork launcher stands in for ssh); a TP=4 group spans both "nodes".

Every rank must see its global RANK, its node-local LOCAL_RANK / LOCAL_SIZE and its node, the CPU
device, and the TP group of all four ranks, which carries an all-reduce across the nodes.
"""
import json
import os
import subprocess
import sys

import pytest

from ds_megatron.utils.dist_env import free_port

from test_launchers import ROOT, _clean_env

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_two_nodes_with_tp_spanning_them(tmp_path):
    out, port = str(tmp_path / "probe"), free_port()
    nodes = [subprocess.Popen(TORCHRUN + ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                                          "--master_addr", "127.0.0.1", "--master_port", str(port),
                                          "tests/multinode_probe.py", "--out", out],
                              cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    records = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(4)]
    for rank, rec in enumerate(records):
        assert rec == {"rank": rank, "local_rank": rank % 2, "node": rank // 2, "local_size": 2, "device": "cpu",
                       "tp_ranks": [0, 1, 2, 3], "tp_rank": rank, "tp_sum": 6}, rec


MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="needs MPICH's mpirun next to the interpreter (test extra)")
def test_deepspeed_launcher_hostfile_with_two_nodes(tmp_path):
    hostfile, out = tmp_path / "hostfile", str(tmp_path / "probe")
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    env = dict(_clean_env(), DS_LAUNCHER="mpich", DS_LAUNCHER_ARGS="-launcher fork", MASTER_ADDR="127.0.0.1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", "launch/deepspeed_multinode.sh", str(hostfile), "tests/multinode_probe.py",
                           "--out", out], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "-hosts node0,node1" in proc.stdout + proc.stderr  # DeepSpeed's multi-node command line
    records = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(4)]
    for rank, rec in enumerate(records):
        assert rec == {"rank": rank, "local_rank": rank % 2, "node": rank // 2, "local_size": 2, "device": "cpu",
                       "tp_ranks": [0, 1, 2, 3], "tp_rank": rank, "tp_sum": 6}, rec
