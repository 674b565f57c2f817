"""Heartbeats and the watchdog (``training/liveness.py``) against a real TCPStore served here: the silent rank is
named with its host, and a store that is gone is said at once (its refused connect), not after the store client's
retries; the watchdog names a stalled rank (rank 0 finds it, the others read its word), a node's ranks together, a
silent rank 0, a store gone or behind a link gone silent, and leaves a busy job (a rank whose main thread is busy for
3 x the limit in a save) and a finished rank alone."""
import datetime
import gc
import re
import socket
import threading
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


# -- the watchdog (megatron.train.heartbeat_timeout_seconds) ---------------------------------------------------------
LOST_AFTER = 1.0


class Watched:
    """Ranks with heartbeats and watchdogs whose ``on_lost`` records (why, when) and tells the others, as the real
    one does before it leaves the process."""

    def __init__(self, world, lost_after=LOST_AFTER):
        self.lost = {}
        self.beats = [Heartbeat(r, world, INTERVAL, lost_after, on_lost=self._recorder(r)) for r in range(world)]

    def _recorder(self, rank):
        def on_lost(why, tell):
            tell()
            self.lost[rank] = (why, time.monotonic())
        return on_lost

    def start(self):
        for beat in self.beats:
            beat.start()
        return self

    def stall(self, rank):  # a stopped process: neither its beat nor its watchdog runs
        beat = self.beats[rank]
        beat._stop.set()
        beat._thread.join()
        beat._watchdog.join()

    def close(self):
        for beat in self.beats:
            beat._stop.set()


def test_the_watchdog_names_a_stalled_rank_and_every_other_rank_leaves(store):
    job = Watched(4).start()
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in range(4)))
        job.stall(3)
        struck = time.monotonic()
        _wait_until(lambda: set(job.lost) == {0, 1, 2})
        host = socket.gethostname()
        why, when = job.lost[0]
        assert why.startswith(f"rank 3 on {host} sent no heartbeat for "), why
        # found one interval or so after its limit (bounds loose enough for a loaded box); the others read rank 0's
        # word within a few intervals more
        assert int(why.split("sent no heartbeat for ")[1].split()[0]) >= round(LOST_AFTER), why
        assert when - struck <= LOST_AFTER + 2.5, when - struck
        for rank in (1, 2):
            assert job.lost[rank][0] == f"{why} (found by rank 0)"
            assert job.lost[rank][1] - when <= 3 * INTERVAL + 2.0
        assert store[0].get("ds_megatron/heartbeat/failed").decode() == f"{why} (found by rank 0)"
    finally:
        job.close()


def test_a_nodes_ranks_whose_beats_stop_a_beat_apart_are_named_together(store):
    job = Watched(4).start()
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in range(4)))
        job.stall(2)
        time.sleep(1.5 * INTERVAL)
        job.stall(3)
        _wait_until(lambda: set(job.lost) == {0, 1})
        assert job.lost[0][0].startswith(f"ranks 2 3 on {socket.gethostname()} sent no heartbeat for "), job.lost
    finally:
        job.close()


def test_the_watchdog_leaves_a_busy_job_and_a_finished_rank_alone(store):
    # Every beat moves (each rank's main thread could be anywhere: the beat is a thread of its own), then rank 2's
    # run ends (finish: its mark says so) while the others run on: nobody is lost in 3 x the limit.
    job = Watched(3).start()
    try:
        time.sleep(1.5 * LOST_AFTER)
        job.beats[2].finish()
        time.sleep(1.5 * LOST_AFTER)
        assert job.lost == {} and not store[0].check(["ds_megatron/heartbeat/failed"])
    finally:
        job.close()


def test_a_silent_rank_0_is_found_by_the_others_while_the_store_lives(store):
    # torchrun: the store is its agent's, so rank 0 stopped leaves the store answering but its count still.
    job = Watched(3).start()
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in range(3)))
        job.stall(0)
        _wait_until(lambda: set(job.lost) == {1, 2})
        assert all(why.startswith(f"rank 0 on {socket.gethostname()} sent no heartbeat for ")
                   for why, _ in job.lost.values()), job.lost
    finally:
        job.close()


def _assert_silent_for_the_limit(why):
    """The watchdog left after the store had not answered for the limit, counted from its last answer (not at the
    first failed read; wall time measured here would also count a loaded box's delays)."""
    silent_for = re.search(r"did not answer for (\d+) s", why)
    assert silent_for and int(silent_for.group(1)) >= round(LOST_AFTER), why


def test_a_store_that_stops_answering_ends_the_job_after_the_limit(store):
    # The deepspeed launcher: the store lives in rank 0's process, so rank 0's node lost takes it along.
    job = Watched(3)
    job.beats[1].start()
    job.beats[2].start()
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in (1, 2)))
        store.clear()
        gc.collect()
        gone = time.monotonic()
        _wait_until(lambda: set(job.lost) == {1, 2})
        for why, when in job.lost.values():
            assert "rank 0's node is lost or cut off" in why, why
            _assert_silent_for_the_limit(why)
            # a connect that times out instead of being refused (the server mid-close) adds the store client's
            # retry (2.5 s)
            assert when - gone <= LOST_AFTER + 3.5, when - gone
    finally:
        job.close()


def _train_with_a_slow_save(cfg):
    """Rank 0 busy in Python for 3 x the heartbeat limit inside the save while rank 1 waits for it in the save's
    collectives: slow, not lost.  Returns (losses, whether this rank's watchdog was running when the save began)."""
    import ds_megatron.checkpointing.api as checkpoints
    from ds_megatron.config.job import load_job
    from ds_megatron.training import liveness
    from ds_megatron.training.train import train
    real, watching = checkpoints.save, []

    def slow_save(*args, **kwargs):
        beat = liveness.current()
        watching.append(beat is not None and beat._watchdog.is_alive())
        if dist.get_rank() == 0:
            end = time.monotonic() + 3 * cfg["megatron"]["train"]["heartbeat_timeout_seconds"]
            while time.monotonic() < end:
                sum(range(1000))
        return real(*args, **kwargs)

    checkpoints.save = slow_save
    try:
        return train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False).losses, watching
    finally:
        checkpoints.save = real


def test_a_rank_busy_for_longer_than_the_heartbeat_limit_is_not_lost(tmp_path):
    from harness import run_on_ranks
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
           "megatron": {"tensor_model_parallel_size": 2,
                        "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16,
                                  "vocab_size": 257},
                        "train": {"train_iters": 1, "lr_warmup_iters": 0, "eval_interval": 100,
                                  "heartbeat_timeout_seconds": 1, "output_dir": str(tmp_path / "run")},
                        "data": {"default_corpus_bytes": 200_000, "split": "90,10"}}}
    (losses0, watching0), (losses1, watching1) = run_on_ranks(2, _train_with_a_slow_save, cfg)
    assert sorted(losses0) == [1] and losses0 == losses1
    assert watching0 == watching1 == [True]  # the watchdog ran through the slow save


class FreezableLink:
    """A TCP relay to the store that can go silent: its connections stay open but nothing passes any more (a link
    cut off: no FIN, no RST), so a connected store client's next op waits without end."""

    def __init__(self, port):
        self.frozen = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port, self.target = self.server.getsockname()[1], port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.server.accept()
            if self.frozen.is_set():
                continue  # accepted (the kernel did), never answered
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        while True:
            data = src.recv(65536)
            if not data:
                return
            while self.frozen.is_set():
                time.sleep(3600)
            dst.sendall(data)


def test_a_store_behind_a_link_gone_silent_ends_the_job_after_the_limit(store, monkeypatch):
    # Ranks on a node cut off: their store ops neither answer nor fail; the watchdog's reads run aside, so it still
    # counts the silence and leaves.
    link = FreezableLink(store[0].port)
    monkeypatch.setenv("MASTER_PORT", str(link.port))
    job = Watched(3)
    job.beats[1].start()
    job.beats[2].start()
    try:
        _wait_until(lambda: all(store[0].check([f"ds_megatron/heartbeat/host/{r}"]) for r in (1, 2)))
        link.frozen.set()
        cut = time.monotonic()
        _wait_until(lambda: set(job.lost) == {1, 2})
        for why, when in job.lost.values():
            _assert_silent_for_the_limit(why)
            assert when - cut <= LOST_AFTER + 3.5, when - cut
    finally:
        job.close()
