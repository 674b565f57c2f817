"""DeepSpeed's multi-node launch over plain OpenSSH, for clusters without pdsh (``DS_LAUNCHER=ssh`` in
``launch/deepspeed_multinode.sh``).

DeepSpeed 0.19 has no ssh runner of its own.  This script is the fan-out its pdsh runner does: it takes
``deepspeed``'s own arguments (parsed by DeepSpeed's parser, so ``--include`` / ``--exclude`` / ``--num_nodes``
pick the same hosts as there), and for node I of the active hosts runs over ssh, in the same directory (the shared
path), the command the pdsh runner gives node I::

    export <what the pdsh runner exports>; cd $PWD; exec python -u -m deepspeed.launcher.launch \
        --world_info=<the active hosts' slots> --node_rank=I --master_addr=... --master_port=... [flags] ARGS

The exports are the pdsh runner's: the login node's ``PYTHON*``/``MLFLOW*``/``MV2*``/``UCX*`` variables (and the
accelerator's), every ``.deepspeed_env`` line (``~`` and ``.``), ``PYTHONPATH`` led by this directory.  Each
node's output comes back line by line prefixed with its host (``198.18.1.2: ...``), as pdsh prints it.

The end: the launcher exits with the first non-zero code a node's session returns (a lost node's session ends
through ssh's keepalives: ``ServerAliveInterval`` in your ssh_config), or 0 when every node's does.  Unlike pdsh it
does not wait for the other nodes to find out on their own: at the first failure it ends the job on every node
still running as Slurm ends a job step, SIGCONT to the node's job (a stopped rank would keep SIGTERM pending
through ``launch.py``'s 30 s grace) and SIGTERM to its ``launch.py``, which ends its ranks.  SIGTERM or SIGINT to
the launcher is passed to every node the same way (``pkill`` over ssh, as the pdsh runner does: the ranks stop at
one step, save it and leave); it waits for the nodes' sessions (bounded) and exits 1, as ``deepspeed`` does.

    python launch/ssh_runner.py --hostfile hostfile --master_addr HEAD --master_port 29500 [--ssh_port 2222] \
        [--launcher_args "ssh options"] [deepspeed options] --module ds_megatron.cli train --config cfg.json
"""
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from deepspeed.accelerator import get_accelerator
from deepspeed.launcher import runner as ds_runner

# After a SIGTERM passed on: launch.py gives its ranks 30 s before SIGKILL; then its session ends.
STOP_WAIT_S = 60


def active_resources(args):
    """The hosts ``deepspeed`` would launch on and their slots, in order (node rank = position), by DeepSpeed's own
    rules."""
    pool = ds_runner.fetch_hostfile(args.hostfile)
    if not pool:
        sys.exit(f"ssh_runner: error: hostfile '{args.hostfile}' not found or empty; write lines like 'node1 slots=4'")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        sys.exit("ssh_runner: error: --num_nodes / --num_gpus cannot be combined with --include / --exclude")
    active = ds_runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    return ds_runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)


def exports(environ):
    """What every node gets before its launcher starts: the pdsh runner's set, ``.deepspeed_env`` last."""
    out = {}
    prefixes = tuple(ds_runner.EXPORT_ENVS + get_accelerator().export_envs())
    for key, value in environ.items():
        if key.startswith(prefixes):
            out[key] = value
    for where in ds_runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(where, ds_runner.DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            for line in open(path):
                if line.strip() and not line.lstrip().startswith("#"):
                    key, value = line.rstrip("\n").split("=", 1)
                    out[key.strip()] = value.strip()
    out["PYTHONPATH"] = os.path.abspath(".") + (":" + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


def launch_command(args, active, node_rank):
    """Node ``node_rank``'s ``launch.py`` command, with the flags DeepSpeed's runner gives it."""
    world_info = ds_runner.encode_world_info(active)
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           f"--node_rank={node_rank}", f"--master_addr={args.master_addr}", f"--master_port={args.master_port}"]
    flags = {"--no_python": args.no_python, "--module": args.module, "--no_local_rank": args.no_local_rank,
             "--bind_cores_to_rank": args.bind_cores_to_rank, "--quiet": args.quiet}
    cmd += [flag for flag, on in flags.items() if on]
    if args.save_pid:
        cmd += ["--save_pid", str(os.getpid())]
    if args.enable_each_rank_log:
        cmd.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_core_list is not None:
        cmd.append(f"--bind_core_list={args.bind_core_list}")
    return cmd + [f"--log_level={args.log_level}", args.user_script, *args.user_args]


def node_command(args, active, node_rank, export):
    """The shell command node ``node_rank`` runs: ``export`` (the shell lines of ``exports``), the shared directory,
    its ``launch.py`` (``exec``: the session's process group is the node's job, for SIGCONT)."""
    launch = shlex.join(launch_command(args, active, node_rank))
    return f"{export}cd {shlex.quote(os.path.abspath('.'))} && exec {launch}"


def end_job_command(master_port):
    """What ends this job on a node: SIGCONT to every process of its ``launch.py``'s group (a stopped rank takes
    SIGTERM only once continued), then SIGTERM to ``launch.py``, which passes it to its ranks.  The job's
    ``launch.py`` is found by its master port; ``[d]`` keeps the pattern from matching the remote shell."""
    pattern = shlex.quote(f"[d]eepspeed\\.launcher\\.launch .*--master_port={master_port}( |$)")
    return f"for p in $(pgrep -f {pattern}); do pkill -CONT -g $p; done; pkill -TERM -f {pattern}"


def _relay(stream, host):
    """A node's output, line by line, prefixed with its host (as pdsh prints it)."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(host.encode() + b": " + line)
        sys.stdout.buffer.flush()


def _ended(code):
    """How a node's session ended, for the launcher's lines (ssh itself exits 255 when the connection is lost)."""
    lost = " (ssh's code for a connection to the node lost or never made)" if code == 255 else ""
    return f"its launcher exited {code}{lost}"


def main(argv):
    args = ds_runner.parse_args(argv)
    active = active_resources(args)
    hosts = list(active)
    if not args.master_addr:
        sys.exit("ssh_runner: error: --master_addr is required (the first node's address)")
    ssh = ["ssh", "-o", "BatchMode=yes", *(["-p", str(args.ssh_port)] if args.ssh_port else []),
           *shlex.split(args.launcher_args)]
    print(f"ssh_runner: running on the following workers: {','.join(hosts)}", flush=True)
    export = "".join(f"export {key}={shlex.quote(value)}; " for key, value in exports(os.environ).items())
    sessions, relays = [], []
    for rank, host in enumerate(hosts):
        proc = subprocess.Popen([*ssh, host, node_command(args, active, rank, export)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        relay = threading.Thread(target=_relay, args=(proc.stdout, host), daemon=True)
        relay.start()
        sessions.append(proc)
        relays.append(relay)

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    first_failed = None  # the first node whose session ended non-zero
    while not stop:
        codes = [p.poll() for p in sessions]
        first_failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
        if first_failed is not None or None not in codes:
            break
        time.sleep(0.2)
    if stop or first_failed is not None:
        if stop:
            print(f"ssh_runner: {signal.Signals(stop[0]).name}: passing SIGTERM to every node's launch.py", flush=True)
        else:
            print(f"ssh_runner: {hosts[first_failed]}: {_ended(sessions[first_failed].returncode)}: "
                  "ending the job on the other nodes (SIGCONT, SIGTERM to their launch.py)", flush=True)
        kills = [subprocess.Popen([*ssh, host, end_job_command(args.master_port)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for host, proc in zip(hosts, sessions) if proc.poll() is None]
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in [*kills, *sessions]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for proc in sessions:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for relay in relays:
        relay.join(timeout=5)
    if stop:
        return 1
    failed = [(host, p.returncode) for host, p in zip(hosts, sessions) if p.returncode != 0]
    for host, code in failed:
        print(f"ssh_runner: {host}: {_ended(code)}", file=sys.stderr, flush=True)
    return sessions[first_failed].returncode if first_failed is not None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
