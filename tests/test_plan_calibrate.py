"""``ds-megatron plan --calibrate``: the measurements become a profile ``--hardware`` reads (a tiny, fast
calibration on two warm gloo ranks; the figures themselves are this box's)."""
import json
import os

import pytest

from harness import run_on_ranks

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
