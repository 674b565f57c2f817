"""DeepSpeed's multi-node launch over plain OpenSSH, for clusters without pdsh (``DS_LAUNCHER=ssh`` in
``launch/deepspeed_multinode.sh``).

DeepSpeed 0.19 has no ssh runner of its own, but its launcher has a per-node mode: ``deepspeed --no_ssh
--node_rank I`` started on every node of the hostfile runs that node's ``launch.py``.  This script is the fan-out
the pdsh runner would do: it takes ``deepspeed``'s own arguments (parsed by DeepSpeed's parser, so
``--include`` / ``--exclude`` / ``--num_nodes`` pick the same hosts as there), and for node I of the active hosts
runs over ssh, in the same directory (the shared path)::

    export <what the pdsh runner exports>; cd $PWD; python -u -m deepspeed.launcher.runner --no_ssh --node_rank=I ARGS

The exports are the pdsh runner's: the login node's ``PYTHON*``/``MLFLOW*``/``MV2*``/``UCX*`` variables (and the
accelerator's), every ``.deepspeed_env`` line (``~`` and ``.``), ``PYTHONPATH`` led by this directory.  Each
node's output comes back line by line prefixed with its host (``198.18.1.2: ...``), as pdsh prints it.

The end, as with pdsh: the launcher waits for every node's session and exits with the first non-zero code
(a lost node's session ends through ssh's keepalives: ``ServerAliveInterval`` in your ssh_config).  SIGTERM or
SIGINT is passed to every node's ``launch.py`` (``pkill -TERM`` over ssh, as the pdsh runner does), which
passes it to its ranks; the launcher waits for the nodes' sessions (bounded) and exits 1, as ``deepspeed`` does.

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

# After a forwarded SIGTERM: launch.py gives its ranks 30 s before SIGKILL; then its session ends.
STOP_WAIT_S = 60


def active_hosts(args):
    """The hosts ``deepspeed`` would launch on, in order (node rank = position), by DeepSpeed's own rules."""
    pool = ds_runner.fetch_hostfile(args.hostfile)
    if not pool:
        sys.exit(f"ssh_runner: error: hostfile '{args.hostfile}' not found or empty; write lines like 'node1 slots=4'")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        sys.exit("ssh_runner: error: --num_nodes / --num_gpus cannot be combined with --include / --exclude")
    active = ds_runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    return list(ds_runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus))


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


def node_command(argv, node_rank, export):
    """The shell command node ``node_rank`` runs: ``export`` (the shell lines of ``exports``), the shared directory,
    DeepSpeed's per-node mode."""
    launch = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--no_ssh", f"--node_rank={node_rank}", *argv]
    return f"{export}cd {shlex.quote(os.path.abspath('.'))} && exec {shlex.join(launch)}"


def _relay(stream, host):
    """A node's output, line by line, prefixed with its host (as pdsh prints it)."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(host.encode() + b": " + line)
        sys.stdout.buffer.flush()


def main(argv):
    args = ds_runner.parse_args(argv)
    hosts = active_hosts(args)
    if not args.master_addr:
        sys.exit("ssh_runner: error: --master_addr is required (the first node's address)")
    ssh = ["ssh", "-o", "BatchMode=yes", *(["-p", str(args.ssh_port)] if args.ssh_port else []),
           *shlex.split(args.launcher_args)]
    print(f"ssh_runner: running on the following workers: {','.join(hosts)}", flush=True)
    export = "".join(f"export {key}={shlex.quote(value)}; " for key, value in exports(os.environ).items())
    sessions, relays = [], []
    for rank, host in enumerate(hosts):
        proc = subprocess.Popen([*ssh, host, node_command(argv, rank, export)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        relay = threading.Thread(target=_relay, args=(proc.stdout, host), daemon=True)
        relay.start()
        sessions.append(proc)
        relays.append(relay)

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    while not stop and any(p.poll() is None for p in sessions):
        time.sleep(0.2)
    if stop:
        # The node's launch.py, found by this job's master port; "[d]" keeps pkill from matching the remote shell.
        pattern = f"[d]eepspeed\\.launcher\\.launch .*--master_port={args.master_port}( |$)"
        print(f"ssh_runner: {signal.Signals(stop[0]).name}: passing SIGTERM to every node's launch.py", flush=True)
        kills = [subprocess.Popen([*ssh, host, f"pkill -TERM -f {shlex.quote(pattern)}"], stdin=subprocess.DEVNULL)
                 for host in hosts]
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
        print(f"ssh_runner: {host}: its launcher exited {code}", file=sys.stderr, flush=True)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
