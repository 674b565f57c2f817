"""DistributedDataParallel on gloo ranks: averaged grads, expert grads over edp only, overlap, no_sync, reduce-scatter.

Every rank feeds its own data, so its local gradient is unique; the expected
reduced gradient is computed from all ranks' local gradients (all-gathered)
with the rule being tested, never through the code under test.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

from ds_megatron.distributed import DistributedDataParallel, DistributedDataParallelConfig
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState


class DenseAndExperts(torch.nn.Module):
    """Four dense layers and one 'expert' weight (marked as DeepSpeed marks MoE params)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        for lin in self.layers:
            with torch.no_grad():
                lin.weight.copy_(torch.randn(8, 8, generator=g) * 0.3)
                lin.bias.copy_(torch.randn(8, generator=g) * 0.1)
        self.expert = torch.nn.Parameter(torch.randn(8, 8, generator=g) * 0.3)
        self.expert.allreduce = False

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return (x @ self.expert).pow(2).mean()


def _local_grads(model, xs):
    """Plain autograd on a copy: this rank's summed grads over micro-batches ``xs`` (name -> tensor)."""
    ref = DenseAndExperts()
    ref.load_state_dict(model.state_dict())
    for x in xs:
        ref(x).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _expected(local, name, state):
    """Dense: mean over dp-cp ranks.  Expert: sum over edp ranks / dp-cp size (Megatron's expert factor)."""
    everyone = _gather(local[name])
    if name == "expert":
        return torch.stack([everyone[r] for r in state.edp.ranks]).sum(0) / state.dp_cp.size
    return torch.stack([everyone[r] for r in state.dp_cp.ranks]).mean(0)


def _reduce_case(ep, overlap, average_in_collective, micro_batches, bucket_size=100):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), ep=ep))
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, average_in_collective=average_in_collective,
                                        bucket_size=bucket_size)
    model = DenseAndExperts()
    ddp = DistributedDataParallel(model, cfg, state)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    xs = [torch.randn(3, 8, generator=g) for _ in range(micro_batches)]
    local = _local_grads(model, xs)

    # Record, at each reduction start, how many params had their grad hooked in so far.
    fired, started_after = [], []
    for group in ddp.all_bucket_groups:
        start = group.start_grad_sync

        def recording(start=start):
            started_after.append(len(fired))
            start()
        group.start_grad_sync = recording
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))

    with ddp.no_sync():
        for x in xs[:-1]:
            ddp(x).backward()
    assert not started_after, "no_sync must not start any reduction"
    fired.clear()
    ddp(xs[-1]).backward()
    started_in_backward = list(started_after)
    ddp.finish_grad_sync()
    ok = {n: torch.allclose(p.main_grad, _expected(local, n, state), atol=1e-6) for n, p in model.named_parameters()}
    grads_freed = all(p.grad is None for p in model.parameters())
    n_groups = len(ddp.all_bucket_groups)
    ddp.zero_grad_buffer()
    zeroed = all(not p.main_grad.any() for p in model.parameters())
    state.destroy()
    return dict(ok=ok, grads_freed=grads_freed, zeroed=zeroed, started_in_backward=started_in_backward,
                n_groups=n_groups, n_params=len(list(model.parameters())), edp=state.layout.edp, dp=state.layout.dp)


def _all_reduce_cases():
    out = []
    for ep, overlap, avg, mb in [(2, True, False, 1), (2, False, True, 3), (2, True, True, 2), (1, False, False, 1)]:
        out.append(((ep, overlap, avg, mb), _reduce_case(ep, overlap, avg, mb)))
    return out


def test_grads_are_averaged_dense_over_dp_and_experts_over_edp_only():
    results = run_on_ranks(4, _all_reduce_cases)
    for rank_results in results:
        for (ep, overlap, avg, mb), res in rank_results:
            assert all(res["ok"].values()), ((ep, overlap, avg, mb), res["ok"])
            assert res["grads_freed"] and res["zeroed"]
            if ep == 2:
                assert (res["dp"], res["edp"]) == (4, 2)  # the layout really separates edp from dp
            if overlap:
                # Several bucket groups, and the first reduction started while backward was still
                # producing grads for other params: that is the overlap.
                assert res["n_groups"] > 2
                assert res["started_in_backward"] and res["started_in_backward"][0] < res["n_params"]
            else:
                assert res["started_in_backward"] == [] and res["n_groups"] <= 2


def _expert_grads_without_edp_would_differ():
    """Guard for the test above: its data tells edp-only from dp-wide expert reduction."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), ep=2))
    model = DenseAndExperts()
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    local = _local_grads(model, [torch.randn(3, 8, generator=g)])
    everyone = torch.stack(_gather(local["expert"]))
    differs = not torch.allclose(_expected(local, "expert", state), everyone.sum(0) / 4, atol=1e-4)
    state.destroy()
    return differs


def test_expert_check_can_tell_edp_from_dp():
    assert all(run_on_ranks(4, _expert_grads_without_edp_would_differ))


def _reduce_scatter_and_param_gather(overlap):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size()))
    dp, me = state.dp_cp.size, state.dp_cp.rank
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=100)
    model = DenseAndExperts()
    model.expert.allreduce = True  # dense only here
    values_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, cfg, state)
    kept = all(torch.equal(p, values_before[n]) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x = torch.randn(3, 8, generator=g)
    local = _local_grads(model, [x])
    ddp(x).backward()
    ddp.finish_grad_sync()
    # Build the fully reduced buffer image by hand, then compare this rank's shard of each bucket.
    shards_ok = []
    for buffer in ddp.buffers:
        full = torch.zeros_like(buffer.grad_data)
        for p in buffer.params:
            s, e, _ = buffer.param_index_map[p]
            name = next(n for n, q in model.named_parameters() if q is p)
            full[s:e] = _expected(local, name, state).flatten()
        for b, (s, e) in enumerate(buffer.bucket_indices):
            shard = (e - s) // dp
            shards_ok.append(torch.allclose(buffer.grad_shard(b, me), full[s + me * shard: s + (me + 1) * shard],
                                            atol=1e-6))
    # Param all-gather: each rank writes its own shard, everyone ends with the full update.
    for buffer in ddp.buffers:
        for b in range(len(buffer.buckets)):
            buffer.param_shard(b, me).fill_(float(me + 1))
    ddp.start_param_sync(force_sync=True)
    gathered_ok = []
    for buffer in ddp.buffers:
        for b, (s, e) in enumerate(buffer.bucket_indices):
            shard = (e - s) // dp
            want = torch.arange(1, dp + 1, dtype=buffer.param_dtype).repeat_interleave(shard)
            gathered_ok.append(torch.equal(buffer.param_data[s:e], want))
    params_are_views = all(p.data_ptr() >= ddp.buffers[0].param_data.data_ptr() for p in model.parameters())
    state.destroy()
    return kept, shards_ok, gathered_ok, params_are_views


@pytest.mark.parametrize("overlap", [False, True])
def test_distributed_optimizer_buffers_reduce_scatter_and_gather(overlap):
    for kept, shards_ok, gathered_ok, views in run_on_ranks(4, _reduce_scatter_and_param_gather, overlap):
        assert kept and views
        assert shards_ok and all(shards_ok)
        assert gathered_ok and all(gathered_ok)
