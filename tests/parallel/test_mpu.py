"""Our mpu against what DeepSpeed's installed source actually calls."""
import os
import re

import deepspeed
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.integration.mpu import MegatronMPU
from ds_megatron.parallel_state import ParallelState

# Attributes DeepSpeed reads off an mpu that we must NOT have:
# `initialize_sequence_parallel` marks a Ulysses mpu (DeepSpeed then ignores our DP group);
# `_init_tp_mesh_device` is only called for DeepSpeed's AutoTP, which ds_megatron replaces.
MUST_NOT_HAVE = {"initialize_sequence_parallel", "_init_tp_mesh_device"}


def deepspeed_mpu_calls():
    root = os.path.dirname(deepspeed.__file__)
    names = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), errors="replace") as fh:
                    names.update(re.findall(r"\bmpu\.([A-Za-z_]+)\s*\(", fh.read()))
    return names


def test_every_mpu_method_deepspeed_calls_exists():
    calls = deepspeed_mpu_calls()
    # Sanity: the scan found the well-known ones, so an empty scan cannot pass.
    assert {"get_model_parallel_rank", "get_data_parallel_group", "get_tensor_model_parallel_world_size"} <= calls
    missing = sorted(c for c in calls - MUST_NOT_HAVE if not hasattr(MegatronMPU, c))
    assert not missing, f"DeepSpeed calls these on an mpu but MegatronMPU lacks them: {missing}"
    for name in MUST_NOT_HAVE:
        assert not hasattr(MegatronMPU, name)


def _mpu_answers(kw):
    layout = ParallelLayout(world_size=dist.get_world_size(), **kw)
    state = ParallelState.build(layout)
    mpu = MegatronMPU(state)
    me = dist.get_rank()
    c = layout.coordinates(me)
    out = dict(
        tp=(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        dp=(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        pp=(mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()),
        mp_size=mpu.get_model_parallel_world_size(),
        sp=(mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()),
        sdp_size=mpu.get_sequence_data_parallel_world_size(),
        ep=(mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()),
        edp_size=mpu.get_expert_data_parallel_world_size(),
        dp_ranks=mpu.get_data_parallel_group_ranks(),
        coords=c,
    )
    # DeepSpeed's own groups module must report the same through the mpu.
    from deepspeed.utils import groups
    groups.mpu = mpu
    out["ds_dp"] = groups._get_data_parallel_world_size()
    out["ds_sp"] = groups._get_sequence_parallel_world_size()
    out["ds_sdp"] = dist.get_world_size(groups._get_sequence_data_parallel_group())
    groups.mpu = None
    state.destroy()
    return out


def test_mpu_reports_megatron_layout_and_keeps_ulysses_off():
    # 8 ranks: TP2 x CP2 x DP2 dense; EP4 x ETP1 x EDP2 expert (folded)
    res = run_on_ranks(8, _mpu_answers, dict(tp=2, cp=2, ep=4, etp=1))
    for rank, out in enumerate(res):
        c = out["coords"]
        assert out["tp"] == (c["tp"], 2) and out["dp"] == (c["dp"], 2) and out["pp"] == (0, 1)
        assert out["mp_size"] == 2
        assert out["sp"] == (0, 1) and out["ds_sp"] == 1, "context parallelism leaked into DeepSpeed's Ulysses size"
        assert out["sdp_size"] == 4 and out["ds_sdp"] == 4, "DeepSpeed must average over dp-cp"
        assert out["ds_dp"] == 2
        assert out["ep"] == (c["ep"], 4) and out["edp_size"] == 2
        assert rank in out["dp_ranks"]
