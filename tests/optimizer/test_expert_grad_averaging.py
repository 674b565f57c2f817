"""The mixed-precision optimizer's own DP averaging: dense grads over dp-cp, expert grads over edp only."""
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.optimizer.megatron_optimizer import Float16OptimizerWithFloat16Params
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel.state import ParallelState


def _averaged_main_grads():
    # 4 ranks, EP=2: dense dp = 4 ranks, each expert replicated over edp = 2 ranks.
    state = ParallelState.build(ParallelLayout(world_size=4, ep=2, etp=1))
    dense = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    expert = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    expert.allreduce = False
    me = dist.get_rank()
    dense.grad = torch.full((3,), float(me + 1), dtype=torch.bfloat16)        # 1, 2, 3, 4
    expert.grad = torch.full((3,), float(10 * (me + 1)), dtype=torch.bfloat16)  # 10, 20, 30, 40
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD([dense, expert], lr=0.0), parallel_state=state,
                                            grad_reduce_group=state.dp_cp.group)
    opt._copy_model_grads_to_main_grads()
    (main_dense, main_expert) = opt.fp32_from_float16_groups[0]
    out = (main_dense.grad[0].item(), main_expert.grad[0].item(), list(state.edp.ranks))
    state.destroy()
    return out


def test_dense_grads_average_over_dp_and_expert_grads_sum_over_edp_divided_by_dp():
    for rank, (dense, expert, edp) in enumerate(run_on_ranks(4, _averaged_main_grads)):
        assert dense == (1 + 2 + 3 + 4) / 4
        # The global-mean convention of DeepSpeed's expert path and Megatron's DDP: sum over the
        # ranks that hold this expert, divided by the dense data-parallel size.
        assert expert == sum(10 * (r + 1) for r in edp) / 4, (rank, edp)
