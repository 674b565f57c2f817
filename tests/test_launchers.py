"""Every launch/ script starts a real 2-rank job that all-reduces (launch/probe.py), and
dist_env maps MPI launcher variables to torch's."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist

from harness import free_port, run_on_ranks
from ds_megatron.integration.runtime import init_distributed_from_env
from ds_megatron.utils.dist_env import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, torch_env_from_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_TIMEOUT = 180  # seconds; a 2-rank probe takes ~3-8 s on an idle 2-core box


# --- pure mapping ---------------------------------------------------------------------------

def test_mpich_variables():
    env = torch_env_from_launcher({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"})
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_SIZE": "4",
                   "MASTER_ADDR": DEFAULT_MASTER_ADDR, "MASTER_PORT": str(DEFAULT_MASTER_PORT)}


def test_openmpi_variables_and_set_values_win():
    env = torch_env_from_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                   "MASTER_PORT": "1234"})
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
                   "MASTER_ADDR": DEFAULT_MASTER_ADDR}


def test_torch_launcher_variables_are_kept_and_local_size_added():
    env = torch_env_from_launcher({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"})
    assert env == {"LOCAL_SIZE": "2"}


def test_no_launcher_is_a_one_rank_job():
    env = torch_env_from_launcher({})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == ("0", "1", "0", "1")


def test_multi_node_mpi_without_master_addr_is_refused():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        torch_env_from_launcher({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"})


def _init_is_a_noop_when_initialized():
    before = (dist.get_rank(), dist.get_world_size(), os.environ["MASTER_PORT"])
    init_distributed_from_env()
    return before == (dist.get_rank(), dist.get_world_size(), os.environ["MASTER_PORT"])


def test_a_free_port_is_outside_the_range_connections_take_their_local_ports_from():
    # A port the kernel hands out from its ephemeral range may become a gloo connection's local end before the store
    # listens on it (EADDRINUSE at a pool's start, seen once in the suite); ours come from below that range.
    import socket
    from ds_megatron.utils.dist_env import _ephemeral_ports
    low, _ = _ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_init_does_nothing_when_already_initialized():
    assert all(run_on_ranks(2, _init_is_a_noop_when_initialized))


# --- real launches ----------------------------------------------------------------------------

def _fake_gpu_tools(tmp_path):
    """A directory with an ``nvidia-smi`` that succeeds, as on a GPU machine (for PATH)."""
    bin_dir = tmp_path / "fake_gpu_bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    tool.chmod(0o755)
    return str(bin_dir)


def _clean_env(tmp_path=None):
    """Our environment without any launcher's variables, so each script starts from nothing.

    These are CPU tests on every machine: the GPU is hidden and DeepSpeed's CPU accelerator
    pinned.  With ``tmp_path`` an ``nvidia-smi`` that succeeds is put first on PATH, so the
    scripts run as on a GPU machine and must still take the CPU path they are told to.
    """
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GLOO_SOCKET_IFNAME"}
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("PMI_", "OMPI_", "MPI_LOCAL"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    if tmp_path is not None:
        env["PATH"] = _fake_gpu_tools(tmp_path) + os.pathsep + env["PATH"]
    return env


def _check_probe(out_dir, world_size):
    records = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            records.append(json.loads(f.read()))
    for rank, rec in enumerate(records):
        assert rec == {"rank": rank, "world_size": world_size, "local_rank": rank, "local_size": world_size,
                       "sum": world_size * (world_size - 1) // 2}


def _without_activation(env):
    """``env`` as a plain shell has it after `bash launch/main.sh` or `bash launch/test.sh` made .venv: no virtualenv
    active and neither deepspeed nor torchrun on PATH (the scripts must find the project's environment)."""
    env = dict(env)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHON", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not os.path.isfile(os.path.join(p, "deepspeed"))
                                  and not os.path.isfile(os.path.join(p, "torchrun")))
    return env


def _launch(argv, tmp_path, activated=True):
    out = tmp_path / "probe"
    env = _clean_env(tmp_path) if activated else _without_activation(_clean_env(tmp_path))
    proc = subprocess.run(argv + ["launch/probe.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    _check_probe(out, 2)


def _has_venv():
    return os.path.isfile(os.path.join(ROOT, ".venv", "bin", "python"))


# The deepspeed and torchrun scripts run from a plain shell (no activation) where .venv exists, which is how CI and
# users run them after launch/setup.sh; with nvidia-smi answering, they must still take the CPU path.
def test_deepspeed_launcher(tmp_path):
    _launch(["bash", "launch/deepspeed_cpu.sh", "2"], tmp_path, activated=not _has_venv())


def test_deepspeed_hostfile_launcher(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node: runs locally, no ssh\nlocalhost slots=2\n")
    _launch(["bash", "launch/deepspeed_multinode.sh", str(hostfile)], tmp_path)


def test_torchrun(tmp_path):
    _launch(["bash", "launch/torchrun.sh", "2"], tmp_path, activated=not _has_venv())


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install 'ds-megatron[mpi]')")
def test_mpirun(tmp_path):
    # No MASTER_PORT: rank 0 picks one and broadcasts it through mpi4py.
    _launch(["bash", "launch/mpirun.sh", "2"], tmp_path)


def test_probe_without_launcher_maps_mpi_variables(tmp_path):
    """A lone process with MPICH's variables (as mpiexec -n 1 gives) becomes rank 0 of 1."""
    env = _clean_env()
    env.update(PMI_RANK="0", PMI_SIZE="1", MASTER_PORT=str(free_port()), PYTHONPATH=ROOT,
               DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo")
    out = tmp_path / "probe"
    proc = subprocess.run([sys.executable, "launch/probe.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_probe(out, 1)


def test_scripts_take_the_cpu_path_they_are_told_to_on_a_gpu_machine(tmp_path):
    """DS_ACCELERATOR=cpu keeps the CPU settings (gloo on loopback) even where nvidia-smi works."""
    probe = "source launch/env.sh; echo \"$DS_ACCELERATOR $GLOO_SOCKET_IFNAME\""
    proc = subprocess.run(["bash", "-c", probe], cwd=ROOT, env=_clean_env(tmp_path), capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and proc.stdout.split() == ["cpu", "lo"], proc.stdout + proc.stderr


def test_bad_rank_count_is_refused():
    proc = subprocess.run(["bash", "launch/torchrun.sh", "two"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "number of ranks" in proc.stderr

