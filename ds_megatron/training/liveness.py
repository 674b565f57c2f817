"""Which ranks went silent: heartbeats in the job's rendezvous store.

A collective that fails on a lost peer tells a rank only that some peer did not answer (gloo names a peer's
address when a connection broke, nothing when the wait timed out).  So every rank of a training job counts
heartbeats in the TCP store the launcher's ranks met at (``MASTER_ADDR:MASTER_PORT``), from a daemon thread on a
store connection of its own, every ``interval`` seconds.  When a collective fails, the rank reads every count
twice, ``2.5 * interval`` apart: the ranks whose count stood still are the silent ones (a node killed or cut off,
a process stopped), named with the host each wrote at start.  A rank that fails the same way marks its count
before it leaves, so the survivors are not named.  Counts, not clocks: the nodes' clocks need not agree.  If the
store itself does not answer, rank 0 has left already or its host (which serves it) is the one lost.  Rank 0's
process serves the store under the ``deepspeed`` launcher, so on a failure rank 0 waits (bounded) for the ranks
already reading the counts to finish before it leaves.  A rank blocked on a survivor (not on the lost peer)
fails only when that survivor leaves, and may find the store gone by then: its line says so.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import List, Optional, Tuple

_PREFIX = "ds_megatron/heartbeat"
_EXITED = -(1 << 40)  # added to a rank's count when it leaves on a failed collective: negative from then on
_current: Optional["Heartbeat"] = None


def _store(timeout_s: float):
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else repr(error)


def interval_for(timeout_minutes: float) -> float:
    """A fifteenth of the collective timeout, between 0.5 and 4 s: the silent ranks are known 2.5 beats (at most
    10 s) after a rank fails, and a thousand ranks beat 250 times a second at most at the default 10 minutes."""
    return min(4.0, max(0.5, timeout_minutes * 60 / 15))


class Heartbeat:
    def __init__(self, rank: int, world: int, interval: float):
        self.rank, self.world, self.interval = rank, world, interval
        self._stop = threading.Event()
        self._store_unreachable = False  # a read found the store gone: leaving need not wait for it again
        self._store_lost: Optional[str] = None  # why the beat, connected before, could not reach the store again
        self._thread = threading.Thread(target=self._beat, name="ds_megatron-heartbeat", daemon=True)

    def _beat(self) -> None:
        try:
            store = _store(max(5.0, 3 * self.interval))
            store.set(f"{_PREFIX}/host/{self.rank}", socket.gethostname())
            store.add(f"{_PREFIX}/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - not reached at the start: a read finds out for itself
            return
        try:
            while not self._stop.wait(self.interval):
                store.add(f"{_PREFIX}/{self.rank}", 1)
        except Exception as e:  # noqa: BLE001 - the store is gone (rank 0 left, or its node is lost or cut off)
            self._store_lost = _first_line(e)

    def _connection(self):
        """A new client of the store.  Its connect retries a refused connection for its whole timeout, twice (9 s
        measured on a killed node), so a plain connect asks first whether anybody listens.  (Not the beat's own
        connection: to a node cut off its ops wait without end.)"""
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5.0).close()
        return _store(5.0)

    def silent_ranks(self) -> Tuple[Optional[List[Tuple[int, str]]], Optional[str]]:
        """([(rank, host)] whose heartbeat stood still, None) or (None, why the store could not be read)."""
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        gone = (f"the job's store at {where} (served by rank 0) does not answer either: rank 0 has left already, or "
                "its node is lost or cut off")
        if self._store_lost is not None:
            self._store_unreachable = True
            return None, f"{gone} (this rank's heartbeat lost it: {self._store_lost})"
        try:
            store = self._connection()
            store.set(f"{_PREFIX}/reading/{self.rank}", "1")  # rank 0 waits for the readers before it leaves
            keys = [f"{_PREFIX}/{r}" for r in range(self.world)]
            first = [store.add(k, 0) for k in keys]
            time.sleep(2.5 * self.interval)
            second = [store.add(k, 0) for k in keys]
            silent = [r for r in range(self.world) if first[r] >= 0 and second[r] == first[r]]
            hosts = []
            for r in silent:
                key = f"{_PREFIX}/host/{r}"
                hosts.append(store.get(key).decode() if store.check([key]) else "?")
            return list(zip(silent, hosts)), None
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
            store.add(f"{_PREFIX}/{self.rank}", _EXITED)
            deadline = time.monotonic() + 2.5 * self.interval + 5.0
            while self.rank == 0 and time.monotonic() < deadline:
                readers = [r for r in range(self.world) if store.check([f"{_PREFIX}/reading/{r}"])]
                if all(store.add(f"{_PREFIX}/{r}", 0) < 0 for r in readers):
                    break
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read the mark
            pass


def start(rank: int, world: int, timeout_minutes: float) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (with a launcher's ``MASTER_ADDR`` / ``MASTER_PORT`` and more than one rank)."""
    global _current
    stop()
    if world < 2 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None
    _current = Heartbeat(rank, world, interval_for(timeout_minutes))
    _current._thread.start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current._stop.set()
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
    by_host = {}
    for rank, host in silent:
        by_host.setdefault(host, []).append(str(rank))
    named = ", ".join(f"rank{'s' if len(r) > 1 else ''} {' '.join(r)} on {h}" for h, r in by_host.items())
    return f"; silent (heartbeat stopped): {named}"


__all__ = ["Heartbeat", "start", "stop", "current", "describe_silent", "interval_for"]
