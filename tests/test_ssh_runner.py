"""``launch/ssh_runner.py`` without nodes (``tests/test_nodes.py`` runs it over ssh): each node's ``launch.py``
command is the one DeepSpeed's own pdsh runner builds for that node, and the command that ends a job on a node
continues its stopped processes and stops its ``launch.py``, and no other job's."""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from deepspeed.launcher import runner as ds_runner
from deepspeed.launcher.multinode_runner import PDSHRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29517


def _ssh_runner():
    spec = importlib.util.spec_from_file_location("ssh_runner", os.path.join(ROOT, "launch", "ssh_runner.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [["--module", "--no_local_rank"], ["--no_python", "--save_pid",
                                                                     "--enable_each_rank_log", "/tmp/logs"]])
def test_each_node_gets_the_launch_command_of_deepspeeds_pdsh_runner(tmp_path, flags):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=2\nn2 slots=4\nn3 slots=2\n")
    args = ds_runner.parse_args(["--hostfile", str(hostfile), "--master_addr", "n1", "--master_port", str(PORT),
                                 "--exclude", "n2:1", *flags, "ds_megatron.cli", "train", "--config", "c.json"])
    ours = _ssh_runner()
    active = ours.active_resources(args)
    assert dict(active) == {"n1": [0, 1], "n2": [0, 2, 3], "n3": [0, 1]}
    pdsh_cmd, _, _ = PDSHRunner(args, ds_runner.encode_world_info(active)).get_cmd({}, active)
    theirs = pdsh_cmd[pdsh_cmd.index(sys.executable):]
    for node_rank in range(len(active)):
        mine = ours.launch_command(args, active, node_rank)
        # the runner's local per-node mode also passes the log level; pdsh's drops it
        assert mine[-5] == f"--log_level={args.log_level}"
        assert mine[:-5] + mine[-4:] == [a.replace("%n", str(node_rank)) for a in theirs]


def _state(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _fake_launch(port):
    """A process whose command line is a node's launch.py's (for ``port``), leading its own process group with a
    child (a rank); returns (leader, child pid)."""
    code = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); c.wait()")
    leader = subprocess.Popen([sys.executable, "-c", code, "-m", "deepspeed.launcher.launch", "--world_info=e30=",
                               f"--master_port={port}", "train.py"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def test_ending_a_job_continues_its_stopped_rank_and_stops_its_launch_py_only():
    ours = _ssh_runner()
    command = ours.end_job_command(PORT)
    assert re.search(command.split("'")[1], f"python -u -m deepspeed.launcher.launch --master_port={PORT} x.py")
    assert not re.search(command.split("'")[1], f"python -u -m deepspeed.launcher.launch --master_port={PORT}1 x")
    (leader, rank), (other, other_rank) = _fake_launch(PORT), _fake_launch(PORT + 1)
    try:
        os.kill(rank, signal.SIGSTOP)
        os.kill(other_rank, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(rank) != "T" or _state(other_rank) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        subprocess.run(["bash", "-c", command], check=True, timeout=30)
        assert leader.wait(timeout=10) == -signal.SIGTERM
        assert _state(rank) != "T"  # continued: a SIGTERM from launch.py reaches it
        assert other.poll() is None and _state(other_rank) == "T"  # another job (port) untouched
    finally:
        for pid in (rank, other_rank):
            os.kill(pid, signal.SIGKILL)
        for proc in (leader, other):
            proc.kill()
            proc.wait()
