"""Real "nodes" on one machine for the multi-node tests (``tests/test_nodes.py``).

Each node is a Linux network namespace with one veth (named ``eth0`` inside, as on a cluster) into a bridge in
the root namespace, an address from 198.18.0.0/15 (reserved for network testing; used only inside the namespaces
made here), its own PID and UTS namespaces (``unshare --pid --fork --kill-child --mount-proc``: killing that
``unshare`` is losing the node, every process on it included) and its own ``sshd`` on its address, with a host
key and a client key made fresh per run.  The filesystem is shared, as on a cluster with shared storage: every
node sees the same paths.  The root namespace is the login node: it reaches every node through the bridge
(``LOGIN`` address) and runs the ``deepspeed`` launcher, whose ``ssh`` is a wrapper on ``PATH`` that adds
``-F ssh_config`` (ssh reads its home directory from the password database, so ``$HOME`` cannot point it at
another config; the user's own ``~/.ssh`` is never touched).

Root only; ``Nodes.start`` raises ``NodesUnavailable`` with the reason where namespaces, veths or sshd cannot be
had (the tests skip with it).  ``Nodes.close`` tears everything down even after a failure, and ``leftovers``
names anything of this run still present (namespaces, links, processes).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Iterator, List, Optional

SSHD = "/usr/sbin/sshd"
PACKAGES = {"sshd": ("openssh-server", SSHD), "pdsh": ("pdsh", "/usr/bin/pdsh"),
            "ssh": ("openssh-client", "/usr/bin/ssh")}


class NodesUnavailable(Exception):
    """Namespaces, veths, sshd or pdsh cannot be had here (the reason is the message)."""


def _run(argv, check=True, timeout=30, **kw):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise NodesUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


def ensure_packages() -> None:
    """openssh-server, openssh-client and pdsh from Debian's packages when missing (CI is root with apt)."""
    missing = [pkg for pkg, path in PACKAGES.values() if not os.path.exists(path)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise NodesUnavailable(f"{', '.join(missing)} missing and no root apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        try:
            _run(argv, timeout=240, env=env)
        except subprocess.TimeoutExpired:
            raise NodesUnavailable(f"`{' '.join(argv)}` took over 240 s") from None
    still = [pkg for pkg, path in PACKAGES.values() if not os.path.exists(path)]
    if still:
        raise NodesUnavailable(f"apt-get did not install {', '.join(still)}")


class Nodes:
    """``n`` nodes; ``addresses[i]`` is node i's, ``hostfile`` lists them with ``slots`` each."""

    IFNAME = "eth0"  # every node's interface, so one GLOO_SOCKET_IFNAME fits all
    SSH_PORT = 2222  # not 22, and not in ssh_config: the launcher must be told (deepspeed --ssh_port)

    def __init__(self, n: int = 2, slots: int = 2):
        self.n, self.slots = n, slots
        tag = f"{os.getpid() % 100000}"
        self.prefix = f"dsmn{tag}"  # namespaces dsmn<tag>-<i>; links dsmb<tag> (bridge), dsmv<tag>-<i>
        self.bridge = f"dsmb{tag}"
        self.netns = [f"{self.prefix}-{i}" for i in range(n)]
        self.veths = [f"dsmv{tag}-{i}" for i in range(n)]
        subnet = 1 + os.getpid() % 250  # 198.18.<subnet>.0/24: a concurrent run elsewhere most likely differs
        self.net = f"198.18.{subnet}"
        self.login = f"{self.net}.1"  # the root namespace's address on the bridge
        self.addresses = [f"{self.net}.{i + 2}" for i in range(n)]
        self.dir = tempfile.mkdtemp(prefix="dsm-nodes-")
        self.bin = os.path.join(self.dir, "bin")  # the ssh wrapper: put it first on the launcher's PATH
        self.ssh_config = os.path.join(self.dir, "ssh_config")
        self.hostfile = os.path.join(self.dir, "hostfile")
        self.inits: List[Optional[subprocess.Popen]] = [None] * n  # each node's unshare (its "power")
        self._made_bridge = False

    # ---- set-up -------------------------------------------------------------------------------------------
    def start(self) -> "Nodes":
        if os.geteuid() != 0:
            raise NodesUnavailable("needs root (network and PID namespaces)")
        for tool in ("ip", "unshare", "ssh-keygen"):
            if not shutil.which(tool):
                raise NodesUnavailable(f"{tool} not found")
        ensure_packages()
        try:
            self._keys()
            self._network()
            for i in range(self.n):
                self._boot(i)
            self._wait_for_ssh()
        except BaseException:
            self.close()
            raise
        return self

    def _keys(self):
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.dir, "host_key")])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.dir, "id_ed25519")])
        shutil.copy(os.path.join(self.dir, "id_ed25519.pub"), os.path.join(self.dir, "authorized_keys"))
        os.chmod(os.path.join(self.dir, "authorized_keys"), 0o600)
        with open(self.ssh_config, "w") as f:
            f.write(f"Host {self.net}.*\n  User root\n  IdentityFile {self.dir}/id_ed25519\n  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
                    "  ConnectTimeout 5\n"
                    # A node cut off sends no FIN or RST: without keepalives its ssh session waits forever.
                    "  ServerAliveInterval 2\n  ServerAliveCountMax 3\n")
        os.makedirs(self.bin)
        wrapper = os.path.join(self.bin, "ssh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.ssh_config} "$@"\n')
        os.chmod(wrapper, 0o755)
        with open(self.hostfile, "w") as f:
            f.writelines(f"{a} slots={self.slots}\n" for a in self.addresses)
        for i in range(self.n):
            with open(os.path.join(self.dir, f"sshd_config.{i}"), "w") as f:
                f.write(f"ListenAddress {self.addresses[i]}\nPort {self.SSH_PORT}\nHostKey {self.dir}/host_key\n"
                        f"AuthorizedKeysFile {self.dir}/authorized_keys\nPidFile none\nStrictModes no\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\n"
                        "UsePAM no\nAcceptEnv *\nPermitUserEnvironment no\nMaxStartups 100\nMaxSessions 100\n"
                        "ClientAliveInterval 2\nClientAliveCountMax 3\n")
        os.makedirs("/run/sshd", exist_ok=True)

    def _network(self):
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made_bridge = True
        _run(["ip", "addr", "add", f"{self.login}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, (ns, veth) in enumerate(zip(self.netns, self.veths)):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            _run(["ip", "link", "set", f"{veth}p", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            inside = ["ip", "netns", "exec", ns]
            _run(inside + ["ip", "link", "set", f"{veth}p", "name", self.IFNAME])
            _run(inside + ["ip", "addr", "add", f"{self.addresses[i]}/24", "dev", self.IFNAME])
            _run(inside + ["ip", "link", "set", self.IFNAME, "up"])
            _run(inside + ["ip", "link", "set", "lo", "up"])

    def _boot(self, i):
        cmd = (f"hostname node{i}; exec {SSHD} -D -e -f {self.dir}/sshd_config.{i}")
        log = open(os.path.join(self.dir, f"sshd.{i}.log"), "w")
        self.inits[i] = subprocess.Popen(["ip", "netns", "exec", self.netns[i], "unshare", "--pid", "--fork",
                                          "--kill-child", "--mount-proc", "--uts", "sh", "-c", cmd],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def ssh(self, i, command, timeout=20):
        return subprocess.run([f"{self.bin}/ssh", "-p", str(self.SSH_PORT), self.addresses[i], command],
                              capture_output=True, text=True, timeout=timeout)

    def _wait_for_ssh(self):
        deadline = time.monotonic() + 30
        for i in range(self.n):
            while True:
                if self.inits[i].poll() is not None:
                    raise NodesUnavailable(f"node {i}'s sshd exited: {self.log(i)[-1000:]}")
                try:
                    proc = self.ssh(i, "hostname", timeout=10)
                    if proc.returncode == 0 and proc.stdout.strip() == f"node{i}":
                        break
                    err = proc.stderr
                except subprocess.TimeoutExpired:
                    err = "timeout"
                if time.monotonic() > deadline:
                    raise NodesUnavailable(f"ssh to node {i} ({self.addresses[i]}) never worked: {err.strip()}; "
                                           f"sshd: {self.log(i)[-1000:]}")
                time.sleep(0.3)

    def log(self, i) -> str:
        try:
            return open(os.path.join(self.dir, f"sshd.{i}.log")).read()
        except OSError:
            return ""

    # ---- faults -------------------------------------------------------------------------------------------
    def kill(self, i):
        """Node i loses power: its unshare is killed, and with it every process in its PID namespace."""
        init = self.inits[i]
        if init is not None and init.poll() is None:
            os.killpg(init.pid, signal.SIGKILL)
            init.wait(timeout=10)

    def revive(self, i):
        """Node i back as at the start (after a kill or a cut): its link up, a fresh init and sshd."""
        self.kill(i)
        _run(["ip", "netns", "exec", self.netns[i], "ip", "link", "set", self.IFNAME, "up"])
        self.inits[i] = None
        self._boot(i)
        self._wait_for_ssh()

    def rank_pid(self, i, rank) -> int:
        """The pid (as the root namespace sees it) of node i's training process of global rank ``rank``."""
        pids = subprocess.run(["ip", "netns", "pids", self.netns[i]], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"ds_megatron.cli" in cmd and b"deepspeed.launcher" not in cmd and f"RANK={rank}".encode() in env:
                return int(pid)
        raise LookupError(f"no rank {rank} on node {i}")

    def stall(self, i, rank):
        """Rank ``rank`` on node i stops (SIGSTOP): alive, connected, silent."""
        os.kill(self.rank_pid(i, rank), signal.SIGSTOP)

    def cut(self, i):
        """Node i's link goes down (no FIN, no RST reaches anyone), its processes keep running."""
        _run(["ip", "netns", "exec", self.netns[i], "ip", "link", "set", self.IFNAME, "down"])

    # ---- tear-down ----------------------------------------------------------------------------------------
    def processes(self) -> List[str]:
        """``pid cmdline`` of every process of this run still alive: anything whose command line names this run's
        directory (sshd, the ranks' configs live there) or that runs in one of its network namespaces."""
        found, mine = [], set()
        for ns in self.netns:
            proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            mine.update(proc.stdout.split())
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if cmd and (self.dir in cmd or pid in mine):
                found.append(f"{pid} {cmd[:200]}")
        return found

    def close(self):
        for i in range(self.n):
            try:
                self.kill(i)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # Anything still inside a namespace (started by ip netns exec outside a node's PID namespace).
        for ns in self.netns:
            proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in proc.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in self.netns:
            if ns in listed:
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        for veth in self.veths:
            subprocess.run(["ip", "link", "delete", veth], capture_output=True)
        if self._made_bridge:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self) -> List[str]:
        """What of this run is still there (empty after ``close``)."""
        left = []
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        left += [f"netns {ns}" for ns in self.netns if ns in listed]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        left += [f"link {name}" for name in [self.bridge, *self.veths] if f" {name}:" in links or f" {name}@" in links]
        left += [f"process {p}" for p in self.processes()]
        if os.path.exists(self.dir):
            left.append(f"directory {self.dir}")
        return left


@contextlib.contextmanager
def started(n: int, slots: int = 2) -> Iterator["Nodes"]:
    """``n`` nodes up for a test module's fixture (the module skipped with the reason where they cannot be had);
    torn down after, failing if anything of them is left."""
    import pytest
    cluster = Nodes(n=n, slots=slots)
    try:
        cluster.start()
    except (NodesUnavailable, subprocess.TimeoutExpired, OSError) as e:
        pytest.skip(f"no namespaced nodes here: {e}")
    try:
        yield cluster
    finally:
        cluster.close()
        left = cluster.leftovers()
        assert not left, f"left behind: {left}"
