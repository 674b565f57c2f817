"""Context parallelism through ``ds-megatron train``: CP=2 (alone, with TP=2 + SP, with PP=2, with MoE, with MoE
routing losses and the expert bias)
trains the CP=1 model on the same global batch: the same per-step and validation losses, the same final weights.

The reference is the single-rank model; the final weights come from each run's last checkpoint, consolidated
to one fp32 ``GPTModel`` state dict (``checkpointing.export_fp32.consolidate``), which is layout-independent.
"The same" is to float32 rounding: every run is compared with the single-rank model trained in float64, within a
small multiple of the float32 single-rank job's own distance from it (``float64_reference.py``).
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from float64_reference import assert_within_float32_noise, train_float64
from ds_megatron.config import ConfigError
from ds_megatron.checkpointing.export_fp32 import consolidate
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

# 2 steps of warmup, 4 of decay: the loss falls by 0.40 to 0.61 (0.3 asserted), and every layout's distance from
# float64 is the same share of its bound as over 10 steps (at most 0.57 of it, with torch's scalar kernels).
STEPS = 6
BASE_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
              "hidden_dropout": 0.0, "attention_dropout": 0.0}


def _config(tmp, cp=1, tp=1, pp=1, ep=1, sp=False, model=None, megatron=None, mbs=2):
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": tp, "context_parallel_size": cp, "pipeline_model_parallel_size": pp,
            "expert_model_parallel_size": ep, "sequence_parallel": sp,
            "model": {**BASE_MODEL, **(model or {})},
            "train": {"train_iters": STEPS, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2, "eval_interval": STEPS,
                      "eval_iters": 1, "save_interval": 0, "output_dir": os.path.join(tmp, "run"), "seed": 5},
            "data": {"default_corpus_bytes": 300_000, "split": "90,10"},
            **(megatron or {}),
        },
    }


def _train(cfg):
    job = load_job(cfg, dist.get_world_size())
    res = train(job, cfg, show_progress=False)
    return res.losses, res.val_losses


def _weights(cfg):
    return consolidate(os.path.join(cfg["megatron"]["train"]["output_dir"], f"iter_{STEPS:07d}"))


def _references(cfg):
    """On one rank: the job in float32 (losses, validation losses, final weights), the same model trained in
    float64, and in float32 again with every micro-batch split in two (another summation order)."""
    fp32 = (*_train(cfg), _weights(cfg))
    return fp32, train_float64(cfg), train_float64(cfg, torch.float32, split=2)


# The one-rank references by the model and dp they stand for: several layouts share one (cp_comm_type chooses how CP
# ranks exchange, nothing at CP=1).  Computed by the first test that needs one, kept for the module's other tests.
_REFERENCES = {}


def _references_of(tmp_path, model, dp):
    model = {k: v for k, v in (model or {}).items() if k != "cp_comm_type"}
    key = json.dumps([model, dp], sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(1, _references, _config(str(tmp_path / "ref"), model=model, mbs=2 * dp))[0]
    return _REFERENCES[key]


def _check_same_run(tmp_path, world, par_kwargs, model=None, dp=1):
    """``world`` ranks with ``par_kwargs`` (dp data-parallel replicas of 2 samples each) against one rank
    reading the same 2 * dp samples per micro-batch.

    Not compared with the one-rank float32 run at a fixed tolerance: float32 rounding depends on the summation
    order (layout, CPU vector width), and Adam turns it into weight differences of ~1e-5 on some elements (one
    element of 4096 ends 1.3e-5 away on one CPU, 4e-6 on another).  Each run is compared with the one-rank
    model trained in float64 instead, within a small multiple of the distance two float32 one-rank runs keep
    from it (``float64_reference.assert_within_float32_noise``).  A layout error (gradients not reduced over
    CP, KV copies or sequence-parallel gradients not summed) moves weights by ~1e-2: 1e3 times that bound."""
    par_cfg = _config(str(tmp_path / "cp"), model=model, **par_kwargs)
    par = run_on_ranks(world, _train, par_cfg)
    fp32, fp64, fp32_split = _references_of(tmp_path, model, dp)
    assert all(r == par[0] for r in par), "ranks disagree on the logged losses"
    losses, val = par[0]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sorted(val) == sorted(fp32[1]) and val
    assert losses[STEPS] < losses[1] - 0.3, "the loss did not fall"
    assert_within_float32_noise((losses, val, _weights(par_cfg)), [fp32, fp32_split], fp64, STEPS)


def test_cp2_trains_the_cp1_model(tmp_path):
    _check_same_run(tmp_path, 2, {"cp": 2})


def test_cp2_all_gather_with_rope_and_gqa_trains_the_cp1_model(tmp_path):
    model = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm",
             "cp_comm_type": "all_gather"}
    _check_same_run(tmp_path, 2, {"cp": 2}, model=model)


def test_cp2_all_to_all_with_rope_and_gqa_trains_the_cp1_model(tmp_path):
    # Ulysses: the sequence split traded for a head split around the attention core.
    model = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm",
             "cp_comm_type": "a2a"}
    _check_same_run(tmp_path, 2, {"cp": 2}, model=model)


def test_cp2_all_to_all_tp2_sequence_parallel_trains_the_cp1_model(tmp_path):
    # Heads split over TP first (2 per rank), then over CP; one KV head per TP rank, expanded for the all-to-all.
    model = {"position_embedding_type": "rope", "num_query_groups": 2, "cp_comm_type": "a2a"}
    _check_same_run(tmp_path, 4, {"cp": 2, "tp": 2, "sp": True}, model=model)


def test_cp4_hierarchical_a2a_within_pairs_and_ring_across_trains_the_cp1_model(tmp_path):
    # hierarchical_context_parallel_sizes [2, 2]: all-to-all inside CP ranks {0, 1} and {2, 3}, the ring across.
    model = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm",
             "cp_comm_type": "a2a+p2p"}
    _check_same_run(tmp_path, 4, {"cp": 4, "megatron": {"hierarchical_context_parallel_sizes": [2, 2]}},
                    model=model)


def test_cp2_tp2_sequence_parallel_rope_trains_the_cp1_model(tmp_path):
    model = {"position_embedding_type": "rope", "num_query_groups": 2, "recompute_granularity": "full"}
    _check_same_run(tmp_path, 4, {"cp": 2, "tp": 2, "sp": True}, model=model)


def test_cp2_pp2_trains_the_cp1_model(tmp_path):
    _check_same_run(tmp_path, 4, {"cp": 2, "pp": 2})


def test_cp2_dp2_distributed_optimizer_trains_the_cp1_model(tmp_path):
    # dp-cp is 4 ranks here: the buffers reduce (and the distributed optimizer shards) over it.
    _check_same_run(tmp_path, 4, {"cp": 2, "megatron": {"use_distributed_optimizer": True}}, dp=2)


def test_cp2_on_deepspeeds_optimizer_path_trains_the_cp1_model(tmp_path):
    # DeepSpeed's own reduction averages over the mpu's sequence-data-parallel group: our dp-cp.
    _check_same_run(tmp_path, 2, {"cp": 2, "megatron": {"optimizer_impl": "deepspeed"}})


def test_cp2_moe_ep2_trains_the_cp1_model(tmp_path):
    model = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
    _check_same_run(tmp_path, 2, {"cp": 2, "ep": 2}, model=model)


# DeepSeek-V3 routing: sigmoid scores with the aux-loss-free expert bias, the sequence-wise balancing loss and the
# z-loss (both means the reference's split micro-batches keep), computed over the whole CP (and SP) sequence.
ROUTED = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_router_score_function": "sigmoid",
          "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01,
          "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}


def test_cp2_moe_routing_losses_and_expert_bias_train_the_cp1_model(tmp_path):
    _check_same_run(tmp_path, 2, {"cp": 2}, model=ROUTED)


def test_cp2_tp2_sp_moe_routing_losses_and_expert_bias_train_the_cp1_model(tmp_path):
    _check_same_run(tmp_path, 4, {"cp": 2, "tp": 2, "sp": True}, model={**ROUTED, "moe_router_num_groups": 2,
                                                                       "moe_router_group_topk": 1})


@pytest.mark.parametrize("changes, fields", [
    ({"context_parallel_size": 2, "model": {**BASE_MODEL, "seq_length": 30}},
     ["model.seq_length 30", "2 * context_parallel_size"]),
    ({"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True,
      "model": {**BASE_MODEL, "seq_length": 36}},
     ["model.seq_length 36", "tensor_model_parallel_size", "sequence_parallel"]),
    ({"context_parallel_size": 2, "model": {**BASE_MODEL, "attention_dropout": 0.1}},
     ["model.attention_dropout", "context_parallel_size"]),
    ({"context_parallel_size": 2, "model": {**BASE_MODEL, "cp_comm_type": "ring"}}, ["model.cp_comm_type"]),
    ({"context_parallel_size": 4, "model": {**BASE_MODEL, "cp_comm_type": "a2a", "num_attention_heads": 2}},
     ["model.cp_comm_type \"a2a\"", "context_parallel_size=4"]),
    ({"context_parallel_size": 4, "model": {**BASE_MODEL, "cp_comm_type": "a2a+p2p"}},
     ["model.cp_comm_type \"a2a+p2p\" needs megatron.hierarchical_context_parallel_sizes"]),
    ({"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2], "model": dict(BASE_MODEL)},
     ["megatron.hierarchical_context_parallel_sizes=[2, 2]", "cp_comm_type"]),
    ({"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 3],
      "model": {**BASE_MODEL, "cp_comm_type": "a2a+p2p"}}, ["hierarchical_context_parallel_sizes=[2, 3]"]),
    ({"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [4, 1],
      "model": {**BASE_MODEL, "cp_comm_type": "a2a+p2p", "num_attention_heads": 2}},
     ["hierarchical_context_parallel_sizes=[4, 1]", "2 attention heads"]),
])
def test_context_parallel_config_errors_name_the_fields(tmp_path, changes, fields):
    cfg = _config(str(tmp_path))
    cfg["megatron"].update(changes)
    with pytest.raises(ConfigError) as err:
        load_job(cfg, 4)
    for field in fields:
        assert field in str(err.value)
