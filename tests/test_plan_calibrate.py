"""``ds-megatron plan --calibrate``: the measurements become a profile ``--hardware`` reads (a tiny, fast
calibration on two warm gloo ranks; the figures themselves are this box's)."""
import json
import os

import pytest

from harness import run_on_ranks

from ds_megatron.errors import ConfigError
from ds_megatron.planning import calibrate
from ds_megatron.planning.hardware import load_hardware
from ds_megatron.planning.report import main


def _collectives():
    return calibrate.measure_collectives(sizes=(64, 1 << 14), repeats=2), calibrate.measure_overlap(1 << 14, 64, 2)


def test_hidden_fraction_by_hand():
    """1 s of GEMMs and a 1 s all-reduce: 2 s one after the other hid nothing, 1 s hid all of the shorter; 2 s
    and 1 s in 2.5 s hid half of the 1 s; a pair slower (faster) than both in turn reads 0 (1)."""
    assert calibrate.hidden_fraction(1.0, 1.0, 2.0) == 0.0
    assert calibrate.hidden_fraction(1.0, 1.0, 1.0) == 1.0
    assert calibrate.hidden_fraction(2.0, 1.0, 2.5) == pytest.approx(0.5)
    assert calibrate.hidden_fraction(1.0, 1.0, 2.5) == 0.0 and calibrate.hidden_fraction(1.0, 1.0, 0.8) == 1.0


def test_latency_and_bandwidth_fitted_by_least_squares_by_hand():
    """Exact points give back their line; the four sizes' means are fitted as a whole (noise on one point moves the
    fit by the least-squares formula, worked by hand), and a line through below zero reads as no latency."""
    exact = [(x, 1e-3 + x / 2e9) for x in (1e3, 1e5, 1e6, 4e6)]
    assert calibrate.fit_latency_bandwidth(exact) == pytest.approx((1e-3, 2e9))
    # (0, 1), (1, 3), (2, 3): means (1, 7/3), slope 2 / 2 = 1, intercept 7/3 - 1 = 4/3
    assert calibrate.fit_latency_bandwidth([(0, 1), (1, 3), (2, 3)]) == pytest.approx((4 / 3, 1.0))
    assert calibrate.fit_latency_bandwidth([(1e6, 1e-4), (2e6, 1.2e-3)]) == pytest.approx((0.0, 1e6 / 1.1e-3))


def test_compute_efficiency_divides_every_compute_price(tmp_path):
    """A profile's ``compute_efficiency`` divides its GEMM, memory-bound and attention prices, not its collectives';
    the reference layers' price (``calibrate.reference_price``, all compute) divides by it as a whole, which is
    what the calibration's efficiency (price over measured time) relies on: a reference measured at 1/0.8 of its
    price gives 0.8.  Out of (0, 2]: refused."""
    gemms = [[64, 64, 64, 5e10], [256, 256, 256, 1e11]]
    rate = {"latency_s": 1e-3, "bus_bytes_per_s": 1e9, "ranks": 2}
    collectives = {kind: dict(rate) for kind in calibrate.KINDS}
    one = calibrate.write_profile(str(tmp_path / "one.json"), gemms, 2e10, collectives, 2, 0.0, 2)
    slow = calibrate.write_profile(str(tmp_path / "slow.json"), gemms, 2e10, collectives, 2, 0.0, 2,
                                   reference=calibrate.reference_price(one) / 0.8)
    assert one.compute_efficiency == 1.0 and slow.compute_efficiency == pytest.approx(0.8, rel=1e-12)
    assert slow.gemm_time(128, 128, 128, "fp32") == pytest.approx(one.gemm_time(128, 128, 128, "fp32") / 0.8)
    assert slow.memory_time(1e6) == pytest.approx(one.memory_time(1e6) / 0.8)
    assert slow.collective_time("all_reduce", 2, 1e6, False) == one.collective_time("all_reduce", 2, 1e6, False)
    assert calibrate.reference_price(slow) == pytest.approx(calibrate.reference_price(one) / 0.8, rel=1e-12)
    for bad in (0.0, 2.5, True):
        doc = json.loads((tmp_path / "one.json").read_text())
        doc["compute_efficiency"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match="compute_efficiency"):
            load_hardware(str(tmp_path / "bad.json"))


def test_calibrate_writes_a_profile_that_hardware_reads(tmp_path, capsys):
    measured, overlap = run_on_ranks(2, _collectives)[0]
    assert set(measured) == set(calibrate.KINDS) and 0.0 <= overlap <= 1.0
    gemms = calibrate.measure_gemms(sizes=(16, 64), repeats=1)
    path = str(tmp_path / "cpu.json")
    profile = calibrate.write_profile(path, gemms, calibrate.measure_memory_bandwidth(1 << 16, 1), measured, 2,
                                       overlap, calibrate.box_cores())
    assert profile == load_hardware(path) and profile.name == "cpu" and profile.comm_overlap == overlap
    assert profile.cores == len(os.sched_getaffinity(0))  # the cores the ranks may run on
    assert calibrate.write_profile(path, gemms, 1e9, measured, 2, 0.25, 1).comm_overlap == 0.25
    # The measured rates are what the plan charges: latency + bus bytes / bus bandwidth, per kind.
    rate = measured["all_gather"]
    assert profile.collective_time("all_gather", 2, 1e6, False) == pytest.approx(
        rate["latency_s"] + 1e6 / rate["bus_bytes_per_s"])
    # And the processor time each rank spends in one, fitted alike: a call takes some.
    assert profile.collective_cpu_time("all_gather", 2, 1e6, False) == pytest.approx(
        rate["cpu_latency_s"] + 1e6 / rate["cpu_bytes_per_s"])
    assert all(profile.collective_cpu_time(kind, 2, 1e4, False) > 0 for kind in calibrate.KINDS)
    # Measured after a long and a short gap of compute; right after another collective the short fit is charged.
    assert 0 < rate["short_gap_s"] < rate["gap_s"]
    assert profile.collective_time("all_gather", 2, 1e6, False, gap=0.0) == pytest.approx(
        rate["short_latency_s"] + 1e6 / rate["short_bus_bytes_per_s"])
    big, small = max(gemms, key=lambda r: r[0] * r[1] * r[2]), min(gemms, key=lambda r: r[0] * r[1] * r[2])
    assert profile.gemm_time(*big[:3], "fp32") == pytest.approx(2 * big[0] * big[1] * big[2] / big[3])
    assert profile.gemm_time(*small[:3], "fp32") == pytest.approx(2 * small[0] * small[1] * small[2] / small[3])
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                  "megatron": {"tensor_model_parallel_size": 2, "model": dict(
                                      num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                      vocab_size=256)}}))
    assert main(["--config", str(config), "--world-size", "2", "--hardware", path, "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["step_time_s"] > 0 and time["breakdown"]["tp_comm_s"] > 0
