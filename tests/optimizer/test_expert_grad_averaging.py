"""The gradient sync of the mixed-precision path: dense grads averaged over dp-cp, expert grads over edp only.

The reducer is the model's gradient buffers (``DistributedDataParallel``), finished by
``finalize_model_grads``; the optimizer wrapper reads the result as its fp32 main grads.
"""
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from ds_megatron.optimizer.megatron_optimizer import Float16OptimizerWithFloat16Params
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState


class _DenseAndExpert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        self.expert = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        self.expert.allreduce = False  # an expert param: reduced over its expert-data-parallel group


def _averaged_main_grads():
    # 4 ranks, EP=2: dense dp = 4 ranks, each expert replicated over edp = 2 ranks.
    state = ParallelState.build(ParallelLayout(world_size=4, ep=2, etp=1))
    model = _DenseAndExpert()
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(), state)
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD([model.dense, model.expert], lr=0.0),
                                            parallel_state=state, model_chunks=[ddp])
    me = dist.get_rank()
    # Local grads: dense 1, 2, 3, 4; expert 10, 20, 30, 40.
    ((model.dense * float(me + 1)).sum() + (model.expert * float(10 * (me + 1))).sum()).backward()
    finalize_model_grads([ddp], state)
    opt._copy_model_grads_to_main_grads()
    (main_dense, main_expert) = opt.fp32_from_float16_groups[0]
    out = (main_dense.grad[0].item(), main_expert.grad[0].item(), list(state.edp.ranks), main_dense.grad.dtype)
    state.destroy()
    return out


def test_dense_grads_average_over_dp_and_expert_grads_sum_over_edp_divided_by_dp():
    for rank, (dense, expert, edp, dtype) in enumerate(run_on_ranks(4, _averaged_main_grads)):
        assert dtype == torch.float32  # 16-bit params get fp32 main grads, reduced in fp32
        assert dense == (1 + 2 + 3 + 4) / 4
        # The global-mean convention of DeepSpeed's expert path and Megatron's DDP: sum over the
        # ranks that hold this expert, divided by the dense data-parallel size.
        assert expert == sum(10 * (r + 1) for r in edp) / 4, (rank, edp)
