"""Two simulated nodes on one machine: two ``torchrun --nnodes 2 --node_rank 0|1`` launches meet at one
rendezvous (127.0.0.1), and a TP=4 group spans both "nodes".

Every rank must see its global RANK, its node-local LOCAL_RANK / LOCAL_SIZE and its node, the CPU
device, and the TP group of all four ranks, which carries an all-reduce across the nodes.
"""
import json
import os
import subprocess
import sys

from ds_megatron.utils.local_job import free_port

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
