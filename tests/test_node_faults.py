"""Each fault under each runner, with the default config (``megatron.train.heartbeat_timeout_seconds`` 30,
``collective_timeout_minutes`` 10): a node killed, a node cut off (link down: no FIN, no RST) and a rank stopped
(SIGSTOP) under DeepSpeed's pdsh runner, ``launch/ssh_runner.py`` and ``torchrun`` (one per node, started over
ssh; its agent, not rank 0, serves the store).  ``tests/test_nodes.py`` runs three of the nine pairs (killed under
pdsh mid-save, cut off and stalled under ssh) with more to check around them; here are the other six, at once, each
job on two nodes of its own, so that their 30 s waits overlap.  For each: every surviving rank is gone within 60 s
of the fault, each of the first node's ranks says one line naming the lost ranks and their host, the launcher exits
non-zero, and ``latest`` names a complete checkpoint.  Root only; skipped where namespaces or sshd cannot be had.
"""
import os
import time

import pytest

from nodes import started
from test_nodes import FaultRun, _assert_named, _job_processes, _no_job_left

PAIRS = [("kill", "ssh"), ("kill", "torchrun"), ("cut", "pdsh"), ("cut", "torchrun"), ("stall", "pdsh"),
         ("stall", "ssh"), ("stall", "torchrun")]
LIMIT_S = 60


@pytest.fixture(scope="module")
def nodes():
    with started(2 * len(PAIRS)) as cluster:
        yield cluster


def _ranks_running(nodes, i):
    """Node i's training ranks still running (not their launcher: DeepSpeed's launch.py, torchrun's agent)."""
    return [line for line in _job_processes(nodes, i) if "-m ds_megatron.cli train" in line
            and "deepspeed.launcher" not in line and "torch.distributed.run" not in line]


def _survivors_running(nodes, run):
    """The job's ranks still running on the nodes the fault spared (for a stalled rank: its node's others too)."""
    left = _ranks_running(nodes, run.pair[0])
    if run.fault == "stall":
        left += [p for p in _ranks_running(nodes, run.pair[1]) if p.split()[0] != str(run.stalled_pid)]
    return left


def test_each_fault_under_each_runner_ends_every_survivor_within_60_s(nodes, tmp_path):
    runs = []
    for k, (fault, launcher) in enumerate(PAIRS):
        (tmp_path / f"{fault}-{launcher}").mkdir()
        runs.append(FaultRun(nodes, tmp_path / f"{fault}-{launcher}", (2 * k, 2 * k + 1), fault, launcher))
    gone = {}
    try:
        while any(run.struck is None for run in runs):
            for run in runs:
                if run.struck is None and run.ready():
                    if run.fault == "stall":
                        run.stalled_pid = nodes.rank_pid(run.pair[1], 3)
                    run.strike()
            time.sleep(0.2)
        while len(gone) < len(runs) and min(time.monotonic() - run.struck for run in runs) < 2 * LIMIT_S:
            for run in runs:
                if run not in gone and not _survivors_running(nodes, run):
                    gone[run] = time.monotonic() - run.struck
            time.sleep(0.3)
    finally:
        ends = {run: run.finish() for run in runs}
    report = [f"{run.fault} / {run.launcher}: every survivor gone {gone.get(run, float('inf')):.1f} s after the "
              f"fault; the launcher exited {ends[run][0]} after {ends[run][1]:.1f} s" for run in runs]
    print("\n".join(report))
    for run in runs:
        output, (first, second) = run.output(), run.pair
        assert gone.get(run, float("inf")) < LIMIT_S, f"{report}\n{output[-4000:]}"
        assert ends[run][0] != 0, f"{report}\n{output[-4000:]}"
        assert ends[run][1] < LIMIT_S, f"{report}\n{output[-4000:]}"
        if run.launcher == "ssh" and run.fault != "kill":  # at a node's exit it ends the job on the other
            assert any(f"ssh_runner: {nodes.addresses[i]}: its launcher exited 4: ending the job on the other nodes"
                       in output for i in run.pair), output[-4000:]
        silent = f"rank 3 on node{second}" if run.fault == "stall" else f"ranks 2 3 on node{second}"
        _assert_named(output, nodes.addresses[first], f"node{first}", silent, watchdog=run.fault != "kill")
        tag = open(os.path.join(run.out, "latest")).read().strip()
        assert os.path.isfile(os.path.join(run.out, tag, ".metadata")), tag
    left = _no_job_left(nodes, deadline_s=60)
    assert not left, [f"{line[:300]} [{_state(line.split()[0])}]" for line in left]


def _state(pid):
    try:
        return open(f"/proc/{pid}/status").read().split("\n")[2] + " wchan=" + open(f"/proc/{pid}/wchan").read()
    except OSError as e:
        return str(e)
