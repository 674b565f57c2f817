"""Several real "nodes" on one machine (``tests/nodes.py``): network and PID namespaces with their own addresses,
interfaces and sshd, reached from the root namespace (the login node) by ``deepspeed --hostfile`` over ssh.

* ``launch/deepspeed_multinode.sh`` with DeepSpeed's pdsh runner, 2 nodes x 2 ranks, TP = 2 inside each node x
  DP = 2 across them, an MoE layer with EP = 2 (x ETP = 2) across them too: the one-node 4-rank run's losses
  exactly; ``metrics.jsonl`` and the checkpoint on the shared path, written once.  PP = 2 across the nodes (the
  cut-off run below, until the cut): the one-node run's losses exactly too.  sshd listens on port 2222 only
  (``--ssh_port`` on every launch); the hostfile lists a third host that does not exist, left out by
  ``--exclude``; the node-loss run names its slots by ``--include``.
* A node lost mid-run, killed (its PID namespace's init dies) or cut off (its link down: no FIN, no RST), with the
  default config (``heartbeat_timeout_seconds`` 30, ``collective_timeout_minutes`` 10): every surviving rank fails
  within 60 s with one line naming itself, its host and the lost ranks with theirs (``training/liveness.py``), the
  launcher exits non-zero within 60 s, nothing of the job is left behind, and ``latest`` names a complete checkpoint.
  The kill strikes node 0 half way through a checkpoint save (``tests/training/slow_save_job.py``: the data written,
  not the metadata): ``latest`` stays on the previous one.  The job then resumes on node 1 alone (TP = 2, DP = 1,
  the global batch kept by gradient accumulation; the torch_dist checkpoint re-sharded), then on both nodes again
  until SIGTERM to the launcher: every node's ranks stop at one step, save it and leave; every step in
  ``metrics.jsonl`` once, in order.  The cut-off run is launched without pdsh: ``DS_LAUNCHER=ssh``
  (``launch/ssh_runner.py``, plain OpenSSH to each node running its `launch.py` as the pdsh runner does).
* The other faults and runners (a rank stopped; torchrun) are in ``tests/test_node_faults.py``.

Root only (CI is root); skipped with the reason where namespaces or sshd cannot be had.  Select with
``pytest tests/test_nodes.py``.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds_megatron.config import ConfigError
from ds_megatron.config.training import TrainConfig
from harness import run_on_ranks
from nodes import Nodes, started
from test_launchers import ROOT, _clean_env

VENV_BIN = os.path.dirname(sys.executable)
# The defaults every fault test runs with: a lost peer is found by the heartbeat watchdog, not the collective timeout.
HEARTBEAT_S = TrainConfig().heartbeat_timeout_seconds
COLLECTIVE_MINUTES = TrainConfig().collective_timeout_minutes
# Each job's wall-clock limit: about 40 s on an idle 2-core box, generous for a loaded one; past it the test fails
# (and the fixture ends everything), it never hangs.
LIMIT_S = 420


@pytest.fixture(scope="module")
def nodes():
    with started(2) as cluster:
        yield cluster


@pytest.mark.parametrize("bad", [0, -1.5, "10"])
def test_a_bad_collective_timeout_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"megatron.train.collective_timeout_minutes must be > 0"):
        TrainConfig(collective_timeout_minutes=bad)


def _group_timeouts(seconds):
    """Every group ParallelState and the pipeline channels make gets the job's collective timeout (torch's
    new_group would take 30 minutes, whatever init_process_group was given)."""
    import datetime

    import torch
    import torch.distributed as dist
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.pipeline_parallel.p2p_communication import PipelineChannels
    from ds_megatron import parallel_state as dist_env

    def timeout_of(pg):
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    before = dist_env.collective_timeout()
    dist_env.set_collective_timeout(datetime.timedelta(seconds=seconds))
    try:
        state = ParallelState.build(ParallelLayout(world_size=2, pp=2))
        channels = PipelineChannels(state)
        mine = [pg for pg in state._owned + channels._all if isinstance(pg, dist.ProcessGroup)]  # not NON_MEMBER
        found = sorted({timeout_of(pg) for pg in mine})
        channels.destroy()
        state.destroy()
        return found
    finally:
        dist_env.set_collective_timeout(before)


def test_every_group_gets_the_collective_timeout():
    assert run_on_ranks(2, _group_timeouts, 77) == [[77.0], [77.0]]


# MoE with EP = 2 x ETP = 2 (expert_model_parallel_size below): with TP = 2 inside each node, each expert-parallel
# group ({0, 2}, {1, 3}) spans the two nodes, so the tokens' all-to-all crosses them.
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}


def _config(out_dir, steps, moe=False, pp=False, **train):
    """The job: TP = 2 inside each node; DP = 2 across them (``moe``: and EP = 2 x ETP = 2 over the four ranks), or
    ``pp``: PP = 2 across them (stage 0 on node 0, stage 1 on node 1; our pipeline runtime, two micro-batches)."""
    return {
        "train_micro_batch_size_per_gpu": 2 // (2 if pp else 1),
        "gradient_accumulation_steps": 2 if pp else 1,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": 2,
            **({"expert_model_parallel_size": 2, "sequence_parallel": True} if moe else {}),
            **({"pipeline_model_parallel_size": 2} if pp else {}),
            "model": {"num_layers": 2 if pp else 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16,
                      "vocab_size": 257, "hidden_dropout": 0.1, "attention_dropout": 0.1, **(MOE if moe else {})},
            "train": {"train_iters": steps, "lr": 3e-3, "lr_decay_style": "constant", "lr_warmup_iters": 0,
                      "eval_interval": 10 ** 6, "eval_iters": 1, "output_dir": out_dir, **train},
            "data": {"default_corpus_bytes": 200_000, "split": "90,10"},
        },
    }


def _job_dir(tmp_path, cfg):
    """The job's directory on the shared path: its config and the ``.deepspeed_env`` every node's ranks get."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "cfg.json").write_text(json.dumps(cfg))
    (job / ".deepspeed_env").write_text(
        f"PATH={VENV_BIN}:/usr/local/bin:/usr/bin:/bin\nDS_ACCELERATOR=cpu\nGLOO_SOCKET_IFNAME={Nodes.IFNAME}\n"
        "OMP_NUM_THREADS=1\nPYTHONUNBUFFERED=1\nCUDA_VISIBLE_DEVICES=\n")
    return job


def _launch(nodes, job, log, hostfile=None, config="cfg.json", *extra, program=("-m", "ds_megatron.cli", "train"),
            **launcher_env):
    """``launch/deepspeed_multinode.sh HOSTFILE -m ds_megatron.cli train --config cfg.json`` from the job directory
    on the login node (its own process group, so a test that fails can end it).  sshd listens on
    ``Nodes.SSH_PORT`` only, so every launch also proves ``--ssh_port`` (``DS_SSH_PORT``); ``launcher_env``:
    ``DS_INCLUDE`` / ``DS_EXCLUDE``."""
    env = dict(_clean_env(), PATH=f"{nodes.bin}:{os.environ['PATH']}", PDSH_SSH_ARGS_APPEND=f"-F {nodes.ssh_config}",
               PYTHON=sys.executable, GLOO_SOCKET_IFNAME=Nodes.IFNAME, OMP_NUM_THREADS="1",
               DS_SSH_PORT=str(Nodes.SSH_PORT), **launcher_env)
    return subprocess.Popen(["bash", os.path.join(ROOT, "launch/deepspeed_multinode.sh"), hostfile or nodes.hostfile,
                             *program, "--config", str(job / config), *extra],
                            cwd=job, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def _losses(path):
    records = [json.loads(line) for line in open(path)]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"metrics.jsonl written more than once per step: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _job_processes(nodes, i):
    """Node i's processes other than its sshd listener (and the unshare / sh that started it)."""
    pids = subprocess.run(["ip", "netns", "pids", nodes.netns[i]], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if cmd and "[listener]" not in cmd and not cmd.startswith(("unshare ", "sh -c hostname")):
            out.append(f"{pid} {cmd}")
    return out


def _no_job_left(nodes, deadline_s=15, among=None):
    deadline = time.monotonic() + deadline_s
    while True:
        left = [p for i in (among or range(nodes.n)) if nodes.inits[i] and nodes.inits[i].poll() is None
                for p in _job_processes(nodes, i)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


def _train_here(cfg):
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    import torch.distributed as dist
    return train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False).losses


def _one_node_losses(tmp_path, steps, moe=False, pp=False, **train):
    """The same job on 4 ranks of one machine (the test harness's gloo ranks, one thread each as on the nodes)."""
    return run_on_ranks(4, _train_here, _config(str(tmp_path / "one_node"), steps, moe, pp, **train))[0]


def test_pdsh_tp2_inside_nodes_dp2_and_ep2_across_them_gives_the_one_node_losses(nodes, tmp_path):
    steps = 4
    out = str(tmp_path / "run")
    job = _job_dir(tmp_path, _config(out, steps, moe=True))
    # The hostfile also lists a host that does not exist, left out by --exclude (pdsh would fail to reach it).
    absent = f"{nodes.net}.250"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(open(nodes.hostfile).read() + f"{absent} slots=2\n")
    with open(tmp_path / "launcher.log", "w") as log:
        code = _wait(_launch(nodes, job, log, str(hostfile), DS_EXCLUDE=absent), timeout=LIMIT_S)
    output = (tmp_path / "launcher.log").read_text()
    assert code == 0, output[-4000:]
    assert "pdsh" in output and nodes.addresses[0] in output and nodes.addresses[1] in output, output[-3000:]
    assert f"Running on the following workers: {nodes.addresses[0]},{nodes.addresses[1]}" in output, output[-3000:]
    losses = _losses(os.path.join(out, "metrics.jsonl"))
    assert sorted(losses) == list(range(1, steps + 1))
    assert open(os.path.join(out, "latest")).read().strip() == f"iter_{steps:07d}"
    assert losses == _one_node_losses(tmp_path, steps, moe=True)
    assert not _no_job_left(nodes)


def _torchrun(nodes, pair, job, logs, program):
    """``torchrun --nnodes 2`` on each node of ``pair``, started over ssh as a user or a scheduler starts it (the
    first node's agent serves the job's store, so rank 0's process does not); returns the two ssh processes."""
    env = " ".join((job / ".deepspeed_env").read_text().split())
    return [subprocess.Popen([f"{nodes.bin}/ssh", "-p", str(Nodes.SSH_PORT), nodes.addresses[i],
                              f"cd {job} && exec env {env} {sys.executable} -m torch.distributed.run --nnodes 2 "
                              f"--node_rank {k} --nproc_per_node 2 --master_addr {nodes.addresses[pair[0]]} "
                              f"--master_port {29400 + pair[0]} {' '.join(program)} --config {job / 'cfg.json'}"],
                             stdout=logs[k], stderr=subprocess.STDOUT, start_new_session=True)
            for k, i in enumerate(pair)]


class FaultRun:
    """A long job on the nodes ``pair`` (2 ranks each, TP = 2 inside them; ``pp``: PP = 2 across them, else DP = 2)
    saving every 2 steps, launched by ``launcher`` (``pdsh``: DeepSpeed's runner; ``ssh``: ``launch/ssh_runner.py``;
    ``torchrun``: one per node), with the default timeouts.  ``ready`` once its checkpoint at step 2 is complete and
    step 4 is logged (``mid_save``: once rank 0, on the first node, has stopped half way through saving step 4's
    checkpoint, ``tests/training/slow_save_job.py``: every rank's data written, the metadata not); then ``strike``
    applies ``fault`` to the pair's second node, or ``target`` (``kill``, ``cut``, ``stall``: SIGSTOP to rank 3)."""

    def __init__(self, nodes, tmp_path, pair, fault, launcher, pp=False, mid_save=False, target=None):
        self.nodes, self.pair, self.fault, self.launcher, self.mid_save = nodes, pair, fault, launcher, mid_save
        self.target = pair[1] if target is None else target
        self.tmp = tmp_path
        self.out = str(tmp_path / "run")
        self.job = _job_dir(tmp_path, _config(self.out, 10 ** 6, pp=pp, save_interval=2))
        self.marker = tmp_path / "saving"
        self.metrics, self.log_paths = os.path.join(self.out, "metrics.jsonl"), [tmp_path / "launcher.log"]
        program = ("-m", "ds_megatron.cli", "train")
        if mid_save:  # every node's ranks get the hook's settings through .deepspeed_env
            with open(self.job / ".deepspeed_env", "a") as env:
                env.write(f"BLOCK_TAG=iter_0000004\nBLOCK_MARKER={self.marker}\n")
            program = (os.path.join(ROOT, "tests", "training", "slow_save_job.py"),)
        addresses = [nodes.addresses[i] for i in pair]
        if launcher == "torchrun":
            self.log_paths = [tmp_path / f"node{i}.log" for i in pair]
            with open(self.log_paths[0], "w") as first, open(self.log_paths[1], "w") as second:
                self.procs = _torchrun(nodes, pair, self.job, (first, second), program)
        else:
            hostfile = tmp_path / "hostfile"
            hostfile.write_text("".join(f"{a} slots=2\n" for a in addresses))
            with open(self.log_paths[0], "w") as log:
                # --include names both nodes' slots (the hostfile's own): the flag reaches DeepSpeed's runner
                self.procs = [_launch(nodes, self.job, log, str(hostfile), program=program, DS_LAUNCHER=launcher,
                                      DS_INCLUDE="@".join(f"{a}:0,1" for a in addresses))]
        self.started, self.struck, self.ended, self._waiters = time.monotonic(), None, [], []
        self.stalled_pid = None

    def output(self) -> str:
        """The launcher's output (torchrun's: each node's, its lines prefixed with the node's address as pdsh
        prints them)."""
        if self.launcher != "torchrun":
            return self.log_paths[0].read_text()
        return "\n".join(f"{self.nodes.addresses[i]}: {line}" for i, path in zip(self.pair, self.log_paths)
                         for line in path.read_text().splitlines())

    def ready(self) -> bool:
        assert all(p.poll() is None for p in self.procs), self.output()[-4000:]
        assert time.monotonic() - self.started < LIMIT_S, "the job never reached step 4: " + self.output()[-4000:]
        if self.mid_save:
            return self.marker.exists()
        return (os.path.exists(self.metrics) and len(_losses(self.metrics)) >= 4
                and os.path.exists(os.path.join(self.out, "latest")))

    def strike(self) -> None:
        node = self.target
        {"kill": lambda: self.nodes.kill(node), "cut": lambda: self.nodes.cut(node),
         "stall": lambda: self.nodes.stall(node, 3)}[self.fault]()
        self.struck = time.monotonic()
        self._waiters = [threading.Thread(target=self._wait_for, args=(p,)) for p in self.procs]
        for waiter in self._waiters:
            waiter.start()

    def _wait_for(self, proc) -> None:
        try:
            self.ended.append((proc.wait(timeout=120), time.monotonic()))
        except subprocess.TimeoutExpired:
            pass

    def finish(self):
        """(exit code, seconds from the fault to the launcher's exit: the last of torchrun's two); ends whatever is
        left of the launcher."""
        for waiter in self._waiters:
            waiter.join()
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if self.struck is None:  # failed before the fault: the caller's error says why
            return None, None
        assert len(self.ended) == len(self.procs), \
            f"{self.fault} / {self.launcher}: the launcher did not exit within 120 s of the fault: " + \
            self.output()[-4000:]
        return max(code for code, _ in self.ended if code is not None), max(t for _, t in self.ended) - self.struck


def _run_until_then(nodes, tmp_path, fault, pp=False, mid_save=False, launcher="pdsh", meanwhile=None, target=1):
    """One ``FaultRun`` on nodes 0 and 1 (``target``: the one struck); ``meanwhile()`` runs while the survivors wait
    for the heartbeat timeout (the CPU idle).  Returns (launcher exit code, seconds from the fault to the launcher's
    exit, output, out dir, what ``meanwhile`` returned)."""
    run = FaultRun(nodes, tmp_path, (0, 1), fault, launcher, pp=pp, mid_save=mid_save, target=target)
    try:
        while not run.ready():
            time.sleep(0.2)
        run.strike()
        also = meanwhile() if meanwhile else None
    finally:
        code, took = run.finish()
    return code, took, run.output(), run.out, also


def _check_after_loss(nodes, code, took, output, out, what, limit=60, among=None):
    print(f"{what}: launcher exited {code} after {took:.1f} s")
    if os.environ.get("DSM_NODES_SHOW"):
        print("\n".join(line for line in output.splitlines()
                        if any(w in line for w in ("Error", "error", "timed out", "Timed out", "lost", "exit"))))
    assert code != 0, output[-4000:]
    assert took < limit, f"{took:.1f} s: " + output[-4000:]
    # Every node's ranks and launch.py are gone, not orphaned (a cut-off node's own after their timeout: on a
    # loaded box that took over 15 s beyond the launcher's exit, so they get the survivors' 60 s).
    assert not _no_job_left(nodes, deadline_s=60, among=among), output[-3000:]
    tag = open(os.path.join(out, "latest")).read().strip()
    assert os.path.isfile(os.path.join(out, tag, ".metadata")) or os.listdir(os.path.join(out, tag)), tag
    return tag


def _resume_on(nodes, tmp_path, hosts, grad_acc, steps, sigterm=False, node=0):
    """``--resume`` on ``node`` alone (``hosts`` 1) or on both over pdsh (2), 2 ranks a node (TP=2 inside it), the
    global batch kept by ``grad_acc``, until step ``steps`` (``sigterm``: SIGTERM to the launcher once step
    ``steps`` is logged); returns the launcher's output."""
    job = tmp_path / "job"
    cfg = json.loads((job / "cfg.json").read_text())
    cfg["gradient_accumulation_steps"] = grad_acc
    cfg["megatron"]["train"].update(train_iters=10 ** 6 if sigterm else steps)
    name = f"resume_{hosts}.json"
    (job / name).write_text(json.dumps(cfg))
    if hosts == 1:  # deepspeed with one host runs locally, not over pdsh: on a cluster, logged in on that node
        proc = nodes.ssh(node, f"cd {job} && PATH={VENV_BIN}:/usr/bin:/bin DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "
                            f"bash {ROOT}/launch/deepspeed_cpu.sh 2 -m ds_megatron.cli train --config {name} --resume",
                         timeout=LIMIT_S)
        code, output = proc.returncode, proc.stdout + proc.stderr
    elif sigterm:
        return _sigterm_at(nodes, tmp_path, job, name, steps)
    else:
        log_path = tmp_path / f"resume_{hosts}.log"
        with open(log_path, "w") as log:
            code = _wait(_launch(nodes, job, log, None, name, "--resume"), timeout=LIMIT_S)
        output = log_path.read_text()
    assert code == 0, output[-4000:]
    return output


def _sigterm_at(nodes, tmp_path, job, name, step):
    """SIGTERM to the head node's launcher once ``step`` is logged.  DeepSpeed's runner passes it on (pdsh's
    ``pkill`` of every node's launch.py, which SIGTERMs its ranks) and exits 1 itself a second later; the ranks of
    both nodes agree to stop at the next step, save, and exit 0 without the launcher.  Returns the output."""
    cfg = json.loads((job / name).read_text())
    out = cfg["megatron"]["train"]["output_dir"]
    metrics, log_path = os.path.join(out, "metrics.jsonl"), tmp_path / "sigterm.log"
    with open(log_path, "w") as log:
        proc = _launch(nodes, job, log, None, name, "--resume")
        deadline = time.monotonic() + LIMIT_S
        while max(_losses(metrics), default=0) < step:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        struck = time.monotonic()
        code = _wait(proc, timeout=60)
    left = _no_job_left(nodes, deadline_s=60)  # the ranks save and leave on their own
    took = time.monotonic() - struck
    output = log_path.read_text()
    print(f"SIGTERM to the launcher: it exited {code}, every node's ranks were gone {took:.1f} s later")
    assert not left, output[-3000:]
    tag = open(os.path.join(out, "latest")).read().strip()
    assert int(tag[len("iter_"):]) > step and os.path.isfile(os.path.join(out, tag, ".metadata")), (tag, output[-3000:])
    return output


def test_a_node_killed_while_saving_ends_the_job_nonzero_and_it_resumes_on_the_other_node_then_both(nodes, tmp_path):
    # Node 0 (rank 0: the checkpoint's coordinator, and the rendezvous store) loses power half way through saving
    # step 4: every rank's data is written, the metadata is not.  Node 1's ranks fail at once, the launcher exits
    # non-zero, and `latest` still names step 2's complete checkpoint.
    code, took, output, out, _ = _run_until_then(nodes, tmp_path, "kill", mid_save=True, target=0)
    try:
        tag = _check_after_loss(nodes, code, took, output, out, "node killed while saving")
        assert tag == "iter_0000002", tag
        half = os.path.join(out, "iter_0000004")
        assert os.path.isdir(half) and not os.path.exists(os.path.join(half, ".metadata")), os.listdir(half)
        lines = [line for line in output.splitlines() if "a peer rank was lost" in line]
        assert {rank for rank in (2, 3) for line in lines
                if line.startswith(f"{nodes.addresses[1]}: ds-megatron train: error: rank {rank} on node1:")} \
            == {2, 3}, output[-4000:]
    finally:
        nodes.revive(0)
    # What is left (node 1: TP=2, DP=1, 2 micro-batches per step: the same global batch) resumes from the torch_dist
    # checkpoint, re-sharded; then both nodes again (DP=2).  Every step is in metrics.jsonl once, in order, with no
    # gap: the lost run's steps after the checkpoint move aside, the resumed runs train them anew.
    saved = int(tag[len("iter_"):])
    metrics = os.path.join(out, "metrics.jsonl")
    lost = [s for s in _losses(metrics) if s > saved]
    t0 = time.monotonic()
    one = _resume_on(nodes, tmp_path, 1, 2, saved + 2, node=1)
    t1 = time.monotonic()
    assert f"--resume at step {saved}: {len(lost)} metrics.jsonl records" in one or not lost, one[-3000:]
    assert sorted(_losses(metrics)) == list(range(1, saved + 3))
    # Back on both nodes, until SIGTERM to the launcher after step saved + 3: every rank saves the step it ends on.
    _resume_on(nodes, tmp_path, 2, 1, saved + 3, sigterm=True)
    print(f"resumed on 1 node in {t1 - t0:.1f} s, then on 2 nodes for {time.monotonic() - t1:.1f} s")
    losses = _losses(metrics)
    last = int(open(os.path.join(out, "latest")).read().strip()[len("iter_"):])
    assert sorted(losses) == list(range(1, last + 1)) and all(v == v and v < 10 for v in losses.values()), losses
    assert not _no_job_left(nodes)


def test_a_node_cut_off_mid_run_ends_the_job_within_the_heartbeat_timeout(nodes, tmp_path):
    # The job is TP = 2 inside the nodes x PP = 2 across them: until the cut, the one-node run's losses exactly;
    # then stage 0 waits on the activations' gradients that never come.
    # The one-node run (the same train_iters: the dataset's sample order depends on it; stopped after step 4 by
    # exit_interval) trains while node 0's ranks wait out their timeout.
    code, took, output, out, one_node = _run_until_then(
        nodes, tmp_path, "cut", pp=True, launcher="ssh",
        meanwhile=lambda: _one_node_losses(tmp_path, 10 ** 6, pp=True, exit_interval=4))
    assert f"ssh_runner: running on the following workers: {nodes.addresses[0]},{nodes.addresses[1]}" in output
    try:
        _check_after_loss(nodes, code, took, output, out, "node cut off")
        assert {s: v for s, v in _losses(os.path.join(out, "metrics.jsonl")).items() if s <= 4} == one_node
        # Node 0's ranks name themselves, their host, the timeout and the silent ranks in one line each, and exit 4.
        _assert_named(output, nodes.addresses[0], "node0", "ranks 2 3 on node1")
    finally:
        nodes.revive(1)


def _assert_named(output, address, host, silent, watchdog=True):
    """The first node's survivors (``address``, hostname ``host``: ranks 0 and 1) print one line each naming the
    ``silent`` ranks: ``watchdog``, found by rank 0's watchdog, which tells rank 1 (the default limits: 30 s of
    silence); else by a collective that failed (a node killed: the connection closed), rank 1's line naming them too
    or, blocked on rank 0 instead, saying the store left with rank 0."""
    lines = [line for line in output.splitlines() if "a peer rank was lost" in line]
    start = f"{address}: ds-megatron train: error: rank {{}} on {host}:"
    mine = {rank: [line for line in lines if line.startswith(start.format(rank))] for rank in (0, 1)}
    assert all(len(m) == 1 for m in mine.values()), output[-4000:]
    if watchdog:
        by_beat = f"{silent} sent no heartbeat for "
        assert by_beat in mine[0][0] and f"heartbeat_timeout_seconds={HEARTBEAT_S:g})" in mine[0][0], output[-4000:]
        assert by_beat in mine[1][0] and "(found by rank 0)" in mine[1][0], output[-4000:]
    else:
        named = (f"silent (heartbeat stopped): {silent};", f"{silent} sent no heartbeat for ")
        assert any(n in mine[0][0] for n in named), output[-4000:]
        assert any(n in mine[1][0] for n in named) or "does not answer" in mine[1][0], output[-4000:]
    return lines
