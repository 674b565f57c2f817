"""Which ranks went silent, and the watchdog that ends the job when one does: heartbeats in the job's store.

Every rank of a training job counts heartbeats in the TCP store the launcher's ranks met at
(``MASTER_ADDR:MASTER_PORT``), from a daemon thread on a store connection of its own, every ``interval`` seconds.
The beat is a thread of its own, so a rank whose main thread is busy for minutes (a slow checkpoint write, an index
built on one rank while the others wait in a collective) still beats: slow is not lost.  Counts, not clocks: the
nodes' clocks need not agree.

The watchdog (``megatron.train.heartbeat_timeout_seconds``, ``lost_after`` here; 0 turns it off), another thread on
every rank, finds a lost peer without waiting for a collective to time out (``collective_timeout_minutes`` must stay
long: a slow save legitimately keeps the other ranks waiting for minutes).  Rank 0 reads every count with one
``multi_get`` per interval; a count that stood still for ``lost_after`` seconds (a node killed or cut off, a process
stopped) is named, with its host, under the job's ``failed`` key.  Every other rank reads that key and rank 0's
count each interval.  Whoever finds the job failed (the key set, rank 0 silent, or the store itself unanswered for
``lost_after``: rank 0's process serves it under the ``deepspeed`` launcher) prints one line and leaves with exit
code 4 at once, whatever its main thread is blocked in, after marking its count; rank 0 first waits (bounded) until
the others have read the key, since the store may leave with it.  Checkpoints are written aside and named by
``latest`` last, so leaving never breaks the last complete one.

When a collective fails instead (gloo names a peer's address when a connection broke, nothing when the wait timed
out), ``silent_ranks`` reads every count twice, ``2.5 * interval`` apart: the ranks whose count stood still are the
silent ones.  A rank that leaves (on a failed collective, or at the end of the run) marks its count negative, so it
is never named.  Each ``start`` uses keys of its own (the launch's restart count and the start's number in this
process), so a store that outlives one run (torchrun's agent) or one process's earlier runs holds no stale marks.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

_PREFIX = "ds_megatron/heartbeat"
_EXITED = -(1 << 40)  # added to a rank's count when it leaves: negative from then on
LOST_PEER_EXIT_CODE = 4
_current: Optional["Heartbeat"] = None
_starts = 0  # starts in this process: every rank starts its heartbeats in the same order, so the numbers agree
_leaving = threading.Lock()  # held by the first thread to end the process on a lost peer: one line per rank


def _store(timeout_s: float):
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else repr(error)


def interval_for(timeout_minutes: float, lost_after: float = 0.0) -> float:
    """A fifteenth of the collective timeout, between 0.5 and 4 s, and a tenth of the watchdog's ``lost_after``
    when it is on: the silent ranks are known 2.5 beats (at most 10 s) after a collective fails, the watchdog sees a
    count stand still within a tenth of its limit, and a thousand ranks beat 330 times a second at most with the
    defaults (10 minutes, 30 s)."""
    interval = min(4.0, max(0.5, timeout_minutes * 60 / 15))
    return min(interval, lost_after / 10) if lost_after > 0 else interval


def _ranks_on_hosts(ranks_hosts: List[Tuple[int, str]]) -> str:
    """"ranks 2 3 on node1, rank 5 on node2"."""
    by_host: Dict[str, List[str]] = {}
    for rank, host in ranks_hosts:
        by_host.setdefault(host, []).append(str(rank))
    return ", ".join(f"rank{'s' if len(r) > 1 else ''} {' '.join(r)} on {h}" for h, r in by_host.items())


def leave_process(line: str, then: Optional[Callable[[], None]] = None, then_limit_s: float = 20.0) -> None:
    """Print ``line`` (one write: a launcher interleaves the ranks' output), run ``then`` (store work, given
    ``then_limit_s`` at most: on a link cut off a store op may wait without end) and end this process with exit code
    4; unless another thread of it is doing so already: then wait for that one."""
    if not _leaving.acquire(blocking=False):
        while True:
            time.sleep(60)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if then is not None:
        worker = threading.Thread(target=then, name="ds_megatron-leaving", daemon=True)
        worker.start()
        worker.join(then_limit_s)
    os._exit(LOST_PEER_EXIT_CODE)


class Heartbeat:
    def __init__(self, rank: int, world: int, interval: float, lost_after: float = 0.0, prefix: str = _PREFIX,
                 on_lost: Optional[Callable[[str, Callable[[], None]], None]] = None):
        self.rank, self.world, self.interval, self.lost_after = rank, world, interval, lost_after
        self.prefix = prefix
        self.on_lost = on_lost or self._leave_on_lost
        self._stop = threading.Event()
        self._store_unreachable = False  # a read found the store gone: leaving need not wait for it again
        self._store_lost: Optional[str] = None  # why the beat, connected before, could not reach the store again
        self._thread = threading.Thread(target=self._beat, name="ds_megatron-heartbeat", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="ds_megatron-watchdog", daemon=True)

    # -- keys --------------------------------------------------------------------------------------------------
    def _count(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _host(self, rank: int) -> str:
        return f"{self.prefix}/host/{rank}"

    def _pid(self, rank: int) -> str:
        return f"{self.prefix}/pid/{rank}"

    @property
    def _failed(self) -> str:
        return f"{self.prefix}/failed"

    def _where(self) -> str:
        return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"

    def start(self) -> "Heartbeat":
        self._thread.start()
        if self.lost_after > 0:
            self._watchdog.start()
        return self

    # -- the beat ----------------------------------------------------------------------------------------------
    def _beat(self) -> None:
        """Count a beat each interval; a beat the store did not take is retried on a new connection (a store
        that answers again is used again: a hiccup must not read as a lost rank)."""
        store, named = None, False
        while True:
            try:
                if store is None:
                    store = _store(max(5.0, 3 * self.interval)) if not named else self._connection()
                if not named:
                    store.set(self._pid(self.rank), str(os.getpid()))
                    store.set(self._host(self.rank), socket.gethostname())
                    named = True
                store.add(self._count(self.rank), 1)
                self._store_lost = None
            except Exception as e:  # noqa: BLE001 - the store is gone (rank 0 left, or its node is lost or cut off)
                store = None
                if named:
                    self._store_lost = _first_line(e)
            if self._stop.wait(self.interval):
                return

    def _connection(self, timeout_s: float = 5.0):
        """A new client of the store.  Its connect retries a refused connection for its whole timeout, twice (9 s
        measured on a killed node), so a plain connect asks first whether anybody listens.  (Not the beat's own
        connection: to a node cut off its ops wait without end.)"""
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                 timeout=timeout_s).close()
        return _store(timeout_s)

    # -- the watchdog ------------------------------------------------------------------------------------------
    def _read(self, state: dict) -> None:
        """One watchdog read (in a thread of its own: on a link cut off, an op of a connected store client waits
        without end): rank 0 every count, the others the ``failed`` key and rank 0's count.  Sets ``state["answer"]``
        to ("failed", why, silent ranks), ("counts", counts) or ("error", exception)."""
        try:
            if state.get("store") is None:
                state["store"] = self._connection(state["op_timeout"])
            store = state["store"]
            if self.rank == 0:
                if not state.get("created"):  # every count exists from here on (0 until the rank's first beat)
                    state["created"] = [store.add(self._count(r), 0) for r in range(1, self.world)]
                answer = ("counts", [int(v) for v in store.multi_get([self._count(r) for r in state["watched"]])])
            elif store.check([self._failed]):
                silent = [int(r) for r in store.get(f"{self._failed}/ranks").decode().split()]
                answer = ("failed", store.get(self._failed).decode(), silent)
            else:
                answer = ("counts", [store.add(self._count(0), 0)])
        except Exception as e:  # noqa: BLE001 - no answer: the store's host (rank 0's node) may be lost
            state["store"] = None
            answer = ("error", e)
        state["answer"] = answer

    def _watch(self) -> None:
        """Each interval a read (``_read``); a count that stood still for ``lost_after`` seconds, the ``failed``
        key set, or no answer from the store for as long (a read that failed or is still waiting) ends the job."""
        state = {"op_timeout": max(1.0, min(5.0, self.lost_after / 4)), "store": None,
                 "watched": list(range(1, self.world)) if self.rank == 0 else [0]}
        last_answer, why_not = time.monotonic(), "no answer"
        changed: Dict[int, Tuple[int, float]] = {}  # rank -> (its count, when this rank saw it change)
        reading: Optional[threading.Thread] = None
        while not self._stop.wait(self.interval):
            if reading is None or not reading.is_alive():  # one read at a time: a stuck one is not repeated
                state.pop("answer", None)
                reading = threading.Thread(target=self._read, args=(state,), name="ds_megatron-watchdog-read",
                                           daemon=True)
                reading.start()
            reading.join(state["op_timeout"])
            now, answer = time.monotonic(), state.get("answer")
            if self._stop.is_set():
                return
            if answer is None or answer[0] == "error":
                why_not = _first_line(answer[1]) if answer else "a read still waits for it"
                if now - last_answer >= self.lost_after:
                    return self._lost(None, f"the job's store at {self._where()} (served by rank 0's process or "
                                            f"its launcher) did not answer for {now - last_answer:.0f} s: rank 0's "
                                            f"node is lost or cut off, or rank 0 is stopped ({why_not})")
                continue
            last_answer, store = now, state["store"]
            if answer[0] == "failed":
                return self._lost(store, answer[1], answer[2])
            counts = answer[1]
            for r, count in zip(state["watched"], counts):
                if r not in changed or changed[r][0] != count:
                    changed[r] = (count, now)
            still = {r: now - changed[r][1] for r, count in zip(state["watched"], counts) if count >= 0}
            if max(still.values(), default=0) >= self.lost_after:
                # with the one past the limit, every rank silent for 3 beats: a node's ranks stop a beat apart
                silent = [r for r, stood in still.items() if stood >= 3 * self.interval]
                stood = max(still.values())
                return self._lost(store, f"{self._name(store, silent)} sent no heartbeat for {stood:.0f} s", silent)

    def _name(self, store, ranks: List[int]) -> str:
        hosts = []
        for r in ranks:
            try:
                hosts.append(store.get(self._host(r)).decode() if store.check([self._host(r)]) else "?")
            except Exception:  # noqa: BLE001 - a name is not worth waiting for
                hosts.append("?")
        return _ranks_on_hosts(list(zip(ranks, hosts)))

    def _lost(self, store, why: str, silent: List[int] = ()) -> None:
        """``on_lost(why, tell)``: by default print the line, ``tell`` the others and leave (``leave_process``)."""
        self._stop.set()
        self.on_lost(why, lambda: self._tell(store, why, silent))

    def _tell(self, store, why: str, silent: List[int]) -> None:
        """Tell the others (the ``failed`` key, once), continue the ``silent`` ranks of this host and mark this rank
        gone; rank 0 waits (bounded) until every rank but the silent ones has marked itself too (it has read the
        key)."""
        if store is None:
            return
        try:
            if not store.check([self._failed]):
                store.set(f"{self._failed}/ranks", " ".join(map(str, silent)))
                store.set(self._failed, f"{why} (found by rank {self.rank})")
            self._continue_stopped(store, silent)
            store.add(self._count(self.rank), _EXITED)
            waited_for = [self._count(r) for r in range(self.world) if r not in silent]
            deadline = time.monotonic() + 2 * self.interval + 5.0
            while self.rank == 0 and time.monotonic() < deadline:
                if all(int(v) < 0 for v in store.multi_get(waited_for)):
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store went too: the others find out by themselves
            pass

    def _continue_stopped(self, store, silent: List[int]) -> None:
        """SIGCONT to the silent ranks on this host: a stopped one (SIGSTOP) then reads the ``failed`` key and
        leaves as well.  Its launcher (DeepSpeed's ``launch.py``, torchrun's agent) would end it by SIGTERM, which
        a stopped process keeps pending through 30 s of grace before SIGKILL.  Only a process that is that rank
        of this job (its environment says so) is signalled."""
        for r in silent:
            try:
                if store.get(self._host(r)).decode() != socket.gethostname():
                    continue
                pid = int(store.get(self._pid(r)))
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                if f"RANK={r}".encode() in env and f"MASTER_PORT={os.environ.get('MASTER_PORT')}".encode() in env:
                    os.kill(pid, signal.SIGCONT)
            except (OSError, ValueError, RuntimeError):  # gone already, another host's pid namespace, no store
                continue

    def _leave_on_lost(self, why: str, tell: Callable[[], None]) -> None:
        leave_process(f"ds-megatron train: error: rank {self.rank} on {socket.gethostname()}: a peer rank was lost: "
                      f"{why} (megatron.train.heartbeat_timeout_seconds={self.lost_after:g}); leaving with exit code "
                      f"{LOST_PEER_EXIT_CODE}; the checkpoint 'latest' names is complete: restart with --resume", tell)

    # -- after a failed collective -----------------------------------------------------------------------------
    def silent_ranks(self) -> Tuple[Optional[List[Tuple[int, str]]], Optional[str]]:
        """([(rank, host)] whose heartbeat stood still, None) or (None, why the store could not be read)."""
        gone = (f"the job's store at {self._where()} (served by rank 0) does not answer either: rank 0 has left "
                "already, or its node is lost or cut off")
        if self._store_lost is not None:
            self._store_unreachable = True
            return None, f"{gone} (this rank's heartbeat lost it: {self._store_lost})"
        try:
            store = self._connection()
            store.set(f"{self.prefix}/reading/{self.rank}", "1")  # rank 0 waits for the readers before it leaves
            keys = [self._count(r) for r in range(self.world)]
            first = [store.add(k, 0) for k in keys]
            time.sleep(2.5 * self.interval)
            second = [store.add(k, 0) for k in keys]
            silent = [r for r in range(self.world) if first[r] >= 0 and second[r] == first[r]]
            return [(r, store.get(self._host(r)).decode() if store.check([self._host(r)]) else "?")
                    for r in silent], None
        except Exception as e:  # noqa: BLE001 - any failure to reach the store is the answer
            self._store_unreachable = True
            return None, f"{gone} ({_first_line(e)})"

    def leave(self) -> None:
        """Stop beating and mark this rank as gone on its own (not to be named by the others).  Rank 0 (the store's
        host under the ``deepspeed`` launcher) then waits until every rank reading the counts has left too, at most
        one read's length and 5 s."""
        self._stop.set()
        if self._store_unreachable:
            return
        try:
            store = self._connection()
            store.add(self._count(self.rank), _EXITED)
            deadline = time.monotonic() + 2.5 * self.interval + 5.0
            while self.rank == 0 and time.monotonic() < deadline:
                readers = [r for r in range(self.world) if store.check([f"{self.prefix}/reading/{r}"])]
                if all(store.add(self._count(r), 0) < 0 for r in readers):
                    break
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read the mark
            pass

    def finish(self) -> None:
        """The run ended: stop beating and watching, and mark this rank gone so a watchdog still running elsewhere
        (rank 0 plotting the loss curve) does not take the end for a loss."""
        self._stop.set()
        if self._store_lost is not None or self._store_unreachable:
            return
        try:
            self._connection(2.0).add(self._count(self.rank), _EXITED)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            pass


def start(rank: int, world: int, timeout_minutes: float, lost_after: float = 0.0) -> Optional[Heartbeat]:
    """Start this rank's heartbeat and, with ``lost_after`` > 0, its watchdog (with a launcher's ``MASTER_ADDR`` /
    ``MASTER_PORT`` and more than one rank)."""
    global _current, _starts
    stop()
    if world < 2 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None
    _starts += 1
    prefix = f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{_starts}"
    _current = Heartbeat(rank, world, interval_for(timeout_minutes, lost_after), lost_after, prefix).start()
    return _current


def stop() -> None:
    """The run ended (or another starts): see ``Heartbeat.finish``."""
    global _current
    if _current is not None:
        _current.finish()
        _current = None


def current() -> Optional[Heartbeat]:
    return _current


def describe_silent() -> str:
    """The part of the lost-peer line that names the silent ranks (empty without heartbeats)."""
    beat = current()
    if beat is None:
        return ""
    silent, unreachable = beat.silent_ranks()
    if unreachable:
        return f"; {unreachable}"
    if not silent:
        return "; every rank's heartbeat still moves (a peer is slow or blocked, not lost)"
    return f"; silent (heartbeat stopped): {_ranks_on_hosts(silent)}"


__all__ = ["Heartbeat", "start", "stop", "current", "describe_silent", "interval_for", "leave_process",
           "LOST_PEER_EXIT_CODE"]
