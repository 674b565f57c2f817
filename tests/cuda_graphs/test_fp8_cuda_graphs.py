"""FP8 under partial CUDA graphs, on CPU: the engine hook's capture path (``CudaGraphHelper``) with a capturer that
does what torch's and Transformer Engine's ``make_graphed_callables`` do before they capture (warm-up passes of each
part on its static inputs, backward with made-up output gradients), then calls the parts instead of replaying
them, with every host read of a tensor's value and every host-to-device copy (``host_reads``, the MoE host-sync
test's list) raising while a part runs, forward and backward.

For each recipe: the loss and every gradient equal the same model's trained without graphs, bit for bit (same
process, same kernels); the delayed recipe's state tensors keep their storages for the whole run while their values
move; the scales the captured GEMMs read are those storages, the ones a replay reads (the addresses of the capture).
With ``fp8_param_gather`` (DP 2, overlapped reductions): the losses and fp8 weights of the eager run, and every
bucket group's reduction still started in backward though a replay runs none of the GEMM's Python.
"""
import copy

import pytest
import torch

from harness import run_on_ranks
from host_reads import TENSOR_METHODS, TORCH_FUNCTIONS

from ds_megatron.config import CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.fp8 import delayed_scaling_groups, update_delayed_scaling
from ds_megatron.fp8 import linear as fp8_linear_module
from ds_megatron.fp8.recipe import ROLES
from ds_megatron.integration.cuda_graphs import attach_cuda_graphs
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel.layers import fp8_states

# blockwise tiles by 128: hidden 128, and a micro-batch of one 128-token sequence (the weight gradient's reduction)
MODEL = dict(num_layers=2, hidden_size=128, num_attention_heads=2, ffn_hidden_size=256, seq_length=128, vocab_size=64,
             make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128)
STEPS, GAS, WARMUP_STEPS = 3, 2, 1


class _InPart:
    """Whether a captured part is running (its forward, or its backward from its outputs' gradients to its
    input's)."""
    active = False


@pytest.fixture
def no_host_reads_in_parts(monkeypatch):
    for owner, names in ((torch.Tensor, TENSOR_METHODS), (torch, TORCH_FUNCTIONS)):
        for name in names:
            def read(*args, _real=getattr(owner, name), _name=f"{owner.__name__}.{name}", **kwargs):
                if _InPart.active:
                    raise AssertionError(f"{_name}() inside a captured part: a host sync, which a CUDA graph "
                                         "cannot record")
                return _real(*args, **kwargs)
            monkeypatch.setattr(owner, name, read)
    yield
    _InPart.active = False


class _BackwardEnters(torch.autograd.Function):
    """On a part's outputs: its backward is where the part's backward starts."""

    @staticmethod
    def forward(ctx, *outputs):
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        _InPart.active = True
        return grads


class _BackwardLeaves(torch.autograd.Function):
    """On a part's input: its backward runs once the part's backward has reached the input."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _InPart.active = False
        return grad


class _ReplayedFP8Weight(torch.nn.Parameter):
    """An fp8 weight (``fp8_param_gather``) whose ``grad_added_to_main_grad`` ignores what a captured part's Python
    sets: a replay runs the captured kernels only."""

    @property
    def grad_added_to_main_grad(self):
        return self.__dict__.get("_added", False)

    @grad_added_to_main_grad.setter
    def grad_added_to_main_grad(self, value):
        if not _InPart.active:
            self.__dict__["_added"] = value


class WarmedCapturer(EagerCapturer):
    """``make_graphed_callables``' warm-up, then the parts called (counted) with host reads refused.  The warm-up's
    output gradients are uninitialized memory in torch and Transformer Engine: here a large constant, which any
    amax the passes record would show; its parameter gradients go through ``autograd.grad`` (not into ``.grad``;
    an fp8 weight's into its ``main_grad``, as in the GEMM's backward).  The fp8 weights' readiness flag is what
    a replay leaves it (``_ReplayedFP8Weight``)."""

    name = "warmed_eager"

    def __init__(self):
        super().__init__()
        self.replays = 0

    def __call__(self, modules, sample_args, *, order, num_layers_per_chunk, num_warmup_iters, reuse_buffers,
                 pool=None):
        for p in (p for module in modules for p in module.parameters() if p.dtype == torch.float8_e4m3fn):
            p.__class__ = _ReplayedFP8Weight
        for module, args in zip(modules, sample_args):
            inputs = [a for a in args if a.requires_grad] + [p for p in module.parameters() if p.requires_grad]
            for _ in range(num_warmup_iters):
                outputs = [o for o in module(*args) if o.requires_grad]
                torch.autograd.grad(outputs, inputs, grad_outputs=[torch.full_like(o, 1e3) for o in outputs],
                                    allow_unused=True)
        parts = super().__call__(modules, sample_args, order=order, num_layers_per_chunk=num_layers_per_chunk,
                                 num_warmup_iters=num_warmup_iters, reuse_buffers=reuse_buffers, pool=pool)
        return [self._guarded(part) for part in parts]

    def _guarded(self, part):
        def replay(hidden):
            self.replays += 1
            hidden = _BackwardLeaves.apply(hidden)
            _InPart.active = True
            try:
                outputs = part(hidden)
            finally:
                _InPart.active = False
            return _BackwardEnters.apply(*outputs)
        return replay


class FakeEngine:
    """What the engine hook reads of DeepSpeed's engine."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")
        self.global_steps = self.micro_steps = 0

    def gradient_accumulation_steps(self):
        return GAS

    def __call__(self, *args):
        return self.module(*args)

    def step(self):
        self.micro_steps += 1
        self.global_steps += self.micro_steps % GAS == 0


def _model(fp8, recipe, moe):
    torch.manual_seed(0)
    return GPTModel(GPTConfig(**MODEL, **(MOE if moe else {}), fp8=fp8, fp8_recipe=recipe)).bfloat16()


def _train(model, engine, on_step=lambda step: None):
    """STEPS optimizer steps of GAS micro-batches: the delayed scales advance once per step, as
    ``finalize_model_grads`` does.  Returns the losses, each step's gradients and its scales after the step."""
    groups = delayed_scaling_groups(ParallelState.single())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, scales = [], [], []
    for step in range(STEPS):
        for micro in range(GAS):
            g = torch.Generator().manual_seed(step * GAS + micro)
            tokens = torch.randint(0, 64, (1, 128), generator=g)
            loss = engine(tokens, torch.roll(tokens, -1, 1))
            loss.backward()
            engine.step()
            losses.append(loss.detach())
        on_step(step)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        update_delayed_scaling(fp8_states(model), groups)
        scales.append([t.clone() for s in fp8_states(model) for t in s.state_tensors()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads, scales


def _graphed(model, scope):
    engine, capturer = FakeEngine(model), WarmedCapturer()
    hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=scope,
                                                      warmup_steps=WARMUP_STEPS), capturer=capturer)
    return engine, hook, capturer


def _storages(model):
    return [t.untyped_storage().data_ptr() for s in fp8_states(model) for t in s.state_tensors()]


@pytest.mark.parametrize("fp8, recipe, scope, moe", [
    ("e4m3", "tensorwise", ["attn"], False),
    ("hybrid", "delayed", ["attn"], False),
    ("e4m3", "delayed", [], False),  # whole layers: the MLP's linears in the graph too
    ("hybrid", "blockwise", ["attn"], False),
    ("hybrid", "delayed", ["attn", "moe_router", "moe_preprocess"], True),  # the shared expert inside the graph
])
def test_graphed_fp8_training_equals_eager_bit_for_bit(no_host_reads_in_parts, fp8, recipe, scope, moe):
    model = _model(fp8, recipe, moe)
    reference = copy.deepcopy(model)
    engine, hook, capturer = _graphed(model, scope)
    originals = [t for s in fp8_states(model) for t in s.state_tensors()]  # held: no storage of theirs is reused
    before = [t.clone() for t in originals]
    losses, grads, scales = _train(model, engine)
    # (c) every captured part ran with host reads refused: replayed each micro-batch after the warm-up steps
    assert hook.num_captures == 1
    assert capturer.replays == (STEPS - WARMUP_STEPS) * GAS * len(hook.helper.runners) > 0
    # (a) the same losses, gradients and scales as without graphs
    ref_losses, ref_grads, ref_scales = _train(reference, FakeEngine(reference))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step}: {name}"
    for step, (got, want) in enumerate(zip(scales, ref_scales)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step}: delayed fp8 state"
    # (b) the delayed state's storages are the ones of the start, and its scales moved
    assert _storages(model) == [t.untyped_storage().data_ptr() for t in originals]
    after = [t for s in fp8_states(model) for t in s.state_tensors()]
    assert (len(after) > 0) == (recipe == "delayed")
    moved = [not torch.equal(a, b) for a, b, kind in zip(after, before, _kinds(model)) if kind == "scale"]
    assert all(moved) and (len(moved) > 0) == (recipe == "delayed"), moved


def _kinds(model):
    """What each of ``state_tensors()`` is, in their order."""
    return [kind for s in fp8_states(model) if s.recipe.recipe == "delayed"
            for kind in ("amax_history", "scale", "step_amax") for _ in ROLES]


def test_the_delayed_scales_replay_reads_are_the_storages_of_the_capture(no_host_reads_in_parts, monkeypatch):
    """What a replay reads: the scales the captured GEMMs quantize with, at every step after the capture, are read
    from the storages the states had before the first step (those a graph captured), and hold the step's scales."""
    model = _model("hybrid", "delayed", moe=False)
    engine, hook, _ = _graphed(model, ["attn"])
    originals = [s.scale[r] for s in fp8_states(model) for r in ROLES]  # held: no storage of theirs is reused
    scale_of_storage = {t.untyped_storage().data_ptr(): (i // len(ROLES), ROLES[i % len(ROLES)])
                        for i, t in enumerate(originals)}
    read = []  # (storage, value) of every scale a captured part quantized with

    def cast(x, scale, dtype, _real=fp8_linear_module.cast):
        if _InPart.active:
            read.append((scale.untyped_storage().data_ptr(), scale.detach().clone()))
        return _real(x, scale, dtype)
    monkeypatch.setattr(fp8_linear_module, "cast", cast)
    per_step = []

    def check(step):
        states = fp8_states(model)
        for storage, value in read:
            assert storage in scale_of_storage, f"step {step}: a captured GEMM read a scale of another storage"
            i, role = scale_of_storage[storage]
            assert torch.equal(value, states[i].scale[role]), f"step {step}: state {i} {role}"
        per_step.append(({storage for storage, _ in read}, [v for _, v in read]))
        read.clear()
    _train(model, engine, check)
    assert per_step[0] == (set(), [])  # the warm-up step runs eagerly
    # 2 layers x (QKV, projection) x 3 roles, read at the capture step and the last one
    assert len(per_step[1][0]) == 12 and per_step[-1][0] == per_step[1][0]
    assert not all(torch.equal(a, b) for a, b in zip(per_step[-1][1], per_step[1][1]))  # the scales moved


def _train_with_fp8_param_gather(graphs: bool):
    """DP 2, the distributed optimizer's fp8 weights (``fp8_param_gather``) with overlapped reductions: each
    micro-batch's loss, whether each bucket group's reduction started in the step's last backward, the fp8 bytes and
    scales after the last step."""
    import ds_megatron
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
           "megatron": {"use_distributed_optimizer": True, "fp8_param_gather": True, "overlap_grad_reduce": True,
                        "overlap_param_gather": True, "bucket_size": 4000}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=80, seq_length=16,
                               vocab_size=64, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                               attention_dropout=0.0, fp8="e4m3"), state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    capturer = WarmedCapturer() if graphs else None
    if graphs:
        attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"],
                                                   warmup_steps=WARMUP_STEPS), capturer=capturer)
    losses, started = [], []
    for step in range(STEPS):
        for micro in range(GAS):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + state.dp.rank)
            tokens = torch.randint(0, 64, (1, 17), generator=g)
            loss = engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
            engine.backward(loss)
            if micro == GAS - 1:
                started.append([group.grad_reduce_handles is not None
                                for group in engine.megatron.ddp.bucket_groups])
            engine.step()
            losses.append(loss.item())
    for group in engine.megatron.ddp.all_bucket_groups:
        group.finish_param_sync()  # the last step's all-gather of the fp8 bytes, overlapped with a next forward
    fp8 = [(p.detach().view(torch.uint8).clone(), p.fp8_scale_inv.clone())
           for p in model.parameters() if p.dtype == torch.float8_e4m3fn]
    engine.megatron.destroy()
    return losses, started, fp8, capturer.replays if graphs else 0


def _both_with_fp8_param_gather():
    return _train_with_fp8_param_gather(False), _train_with_fp8_param_gather(True)


def test_fp8_param_gather_under_graphs_trains_as_eager_and_its_buckets_still_start_in_backward():
    """The captured fp8 weights' gradients enter ``main_grad`` inside the graph's backward: the warm-up's are taken
    back, and a replay tells the buffer they are in (the GEMM's Python does not run), so every bucket group's
    reduction still starts in backward; the losses and the fp8 weights are the eager run's, bit for bit."""
    for (losses, started, fp8, _), (g_losses, g_started, g_fp8, replays) in run_on_ranks(
            2, _both_with_fp8_param_gather):
        assert replays == (STEPS - WARMUP_STEPS) * GAS * 2
        assert g_losses == losses and len(set(losses)) == len(losses)
        assert all(all(s) for s in started) and g_started == started, (started, g_started)
        assert len(fp8) == 8 and all(torch.equal(a, b) and torch.equal(sa, sb) for (a, sa), (b, sb) in zip(g_fp8, fp8))
