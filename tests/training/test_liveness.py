"""Heartbeats (``training/liveness.py``) against a real TCPStore served here: the silent rank is named with its
host, and a store that is gone is said at once (its refused connect), not after the store client's retries."""
import datetime
import gc
import socket
import time

import pytest
import torch.distributed as dist

from ds_megatron.training.liveness import Heartbeat

INTERVAL = 0.1


@pytest.fixture
def store(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return [server]


def _beating(world):
    beats = [Heartbeat(rank, world, INTERVAL) for rank in range(world)]
    for beat in beats:
        beat._thread.start()
    return beats


def _wait_until(condition, limit_s=10):
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(INTERVAL)


def test_the_rank_whose_beat_stopped_is_named_with_its_host(store):
    beats = _beating(3)
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in range(3)))
        beats[2]._stop.set()  # stalled: no more beats, nothing said
        beats[2]._thread.join()
        assert beats[0].silent_ranks() == ([(2, socket.gethostname())], None)
        beats[1].leave()  # a rank that fails on its own marks itself: not named
        assert beats[0].silent_ranks() == ([(2, socket.gethostname())], None)
    finally:
        for beat in beats:
            beat._stop.set()


def test_a_store_that_is_gone_is_said_at_once(store):
    noticed = Heartbeat(0, 3, INTERVAL)  # its beat finds the store gone before the read
    connected = Heartbeat(1, 3, 3600.0)  # connected, no beat since: the read finds out
    never = Heartbeat(2, 3, INTERVAL)  # its beat never ran
    for beat in (noticed, connected):
        beat._thread.start()
    _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in (0, 1)))
    store.clear()
    gc.collect()  # the server stops with its last reference
    _wait_until(lambda: noticed._store_lost is not None)
    reads = {name: beat.silent_ranks() for name, beat in
             (("noticed", noticed), ("connected", connected), ("never", never))}
    for silent, why in reads.values():
        assert silent is None and "(served by rank 0) does not answer either" in why, why
        # not the store client's own connect, which retries a refused connect for its timeout, twice
        assert "trying to connect" not in why, why
    assert "this rank's heartbeat lost it" in reads["noticed"][1]
    assert "Connection refused" in reads["connected"][1] and "Connection refused" in reads["never"][1]
    for beat in (noticed, connected, never):
        beat._stop.set()
        assert beat._store_unreachable  # leaving does not try the store again
