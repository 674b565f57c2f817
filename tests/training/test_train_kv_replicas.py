"""Grouped-query attention with more TP ranks than KV groups, through ``ds-megatron train``.

Each KV group's projection is copied on ``tp / groups`` consecutive TP ranks, and each copy's gradient covers
only its rank's query heads.  Our optimizer path sums the copies' gradients once per step with the other
TP-partial gradients (``allreduce_tp_partial_grads``), DeepSpeed's in every backward (tensor hooks); with two
micro-batches per step (the accumulated gradients are what is summed) both train the one-rank model: the same
losses and the same final weights, to float32 rounding (``_check_same_run``: within a small multiple of the
float32 one-rank job's distance from the one-rank model trained in float64).
"""
import pytest

from test_train_context_parallel import _check_same_run

GQA = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm"}


@pytest.mark.parametrize("par", [{"tp": 4}, {"tp": 4, "sp": True}, {"tp": 4, "megatron": {"optimizer_impl": "deepspeed"}}],
                         ids=["megatron", "megatron-sp", "deepspeed"])
def test_tp4_with_two_kv_groups_trains_the_one_rank_model(tmp_path, par):
    _check_same_run(tmp_path, 4, par, model=GQA)


def test_tp4_with_one_kv_group_trains_the_one_rank_model(tmp_path):
    # One group copied on all four ranks.
    _check_same_run(tmp_path, 4, {"tp": 4}, model={**GQA, "num_query_groups": 1})


def test_tp2_dp2_distributed_optimizer_with_one_kv_group_trains_the_one_rank_model(tmp_path):
    # The copies' gradients are summed after the reduce-scatter: each rank's shard of them is what it applies.
    _check_same_run(tmp_path, 4, {"tp": 2, "megatron": {"use_distributed_optimizer": True}},
                    model={**GQA, "num_query_groups": 1}, dp=2)


def test_tp2_pp2_with_one_kv_group_trains_the_one_rank_model(tmp_path):
    # Each stage sums its own copies in the step.  (DeepSpeed's path with PP refuses this job's clipping.)
    _check_same_run(tmp_path, 4, {"tp": 2, "pp": 2}, model={**GQA, "num_query_groups": 1})
