"""The pipeline engine's step across stages: one skip decision, tied gradients equal, reductions in the last backward."""
import sys

import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.distributed.bucket_group import ParamAndGradBucketGroup
from ds_megatron.models import GPTConfig
from ds_megatron.tensor_parallel import grad_of

MODEL = dict(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=40,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=4)
GAS = 4


def _batches(step, dp_rank):
    g = torch.Generator().manual_seed(10 * step + dp_rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (GAS, 2, MODEL["seq_length"] + 1), generator=g)
    return iter([(t[:, :-1], (t[:, 1:], torch.ones(2, MODEL["seq_length"]))) for t in tokens])


def _engine(extra=None, megatron=None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "megatron": {"pipeline_model_parallel_size": 2, **(megatron or {})}, **(extra or {})}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(5)
    model = ds_megatron.GPTPipelineModule(GPTConfig(**MODEL), state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    return state, model, engine


def _inf_on_the_last_stage_only():
    state, model, engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}})
    last = state.pp.rank == state.pp.size - 1
    engine.train_batch(_batches(0, state.dp.rank))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale_before = engine.optimizer.get_loss_scale().item()
    poison = None
    if last:  # one gradient on one stage overflows
        final_norm = dict(model.named_parameters())[f"{MODEL['num_layers'] + 2}.weight"]
        poison = final_norm.register_hook(lambda g: torch.full_like(g, float("inf")))
    engine.train_batch(_batches(1, state.dp.rank))
    if poison is not None:
        poison.remove()
    unchanged = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    out = dict(skipped=engine.skipped_steps, unchanged=unchanged, scale_before=scale_before,
               scale_after=engine.optimizer.get_loss_scale().item())
    engine.train_batch(_batches(2, state.dp.rank))  # and the next step is taken again
    out["moved_after"] = not all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    engine.megatron.destroy()
    return out


def test_an_inf_on_one_stage_makes_every_stage_skip():
    for rank, r in enumerate(run_on_ranks(4, _inf_on_the_last_stage_only)):
        assert r["skipped"] == 1 and r["unchanged"], (rank, r)
        assert r["scale_after"] == r["scale_before"] / 2, (rank, r)
        assert r["moved_after"], rank


def _tied_grads_and_reduction_timing(distopt):
    state, model, engine = _engine(megatron={"overlap_grad_reduce": True, "bucket_size": 200,
                                             "use_distributed_optimizer": distopt})
    starts = []
    original = ParamAndGradBucketGroup.start_grad_sync

    def spy(group):
        in_backward = any(f.f_code.co_name == "_exec_backward_pass" for f in _frames())
        starts.append((in_backward, engine.megatron.ddp_in_engine._backwards))
        return original(group)

    ParamAndGradBucketGroup.start_grad_sync = spy
    equal = []
    try:
        for step in range(3):
            engine.train_batch(_batches(step, state.dp.rank))
            if state.pp.rank in (0, state.pp.size - 1) and not distopt:
                emb = state["embedding"]
                grad = grad_of(model.tied_modules.word_embeddings.weight).detach().clone()
                first = grad.clone()
                dist.broadcast(first, src=emb.ranks[0], group=emb.group)
                equal.append(torch.equal(grad, first))
    finally:
        ParamAndGradBucketGroup.start_grad_sync = original
    groups = len(engine.megatron.ddp.bucket_groups)
    engine.megatron.destroy()
    return dict(equal=equal, starts=starts, groups=groups)


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_tied_grads_equal_and_reductions_start_in_the_last_backward():
    for distopt in (False, True):
        for rank, r in enumerate(run_on_ranks(4, _tied_grads_and_reduction_timing, distopt)):
            # Every rank of this 2-stage layout holds a copy (first or last stage); with the distributed
            # optimizer only each rank's shard of the buffer is reduced, so whole grads are compared without it.
            assert distopt or r["equal"] == [True] * 3, (rank, r["equal"])
            # Every bucket group's reduction starts inside the step's last backward (overlapped), none earlier.
            assert r["groups"] > 1, "one bucket group: the timing check would be empty"
            assert r["starts"] == [(True, GAS)] * (3 * r["groups"]), (rank, distopt, r["starts"])
