"""What a layer keeps for backward: RMSNorm and RoPE cost no more than LayerNorm and learned positions.

Counted exactly: the distinct storages autograd holds after a forward (``saved_tensors_hooks``), so a view that
keeps a whole buffer alive counts the buffer.  Written as plain autograd ops, RMSNorm also kept its normalized
input (one more [s, b, h] per norm in float32; a 16-bit input's float32 copy too), and RoPE's new q and k left the
QKV projection's output alive through v, a view of it (two more [s, b, h] per layer).  RMSNorm's own backward is
held to autograd of the plain formula.
"""
import pytest
import torch

from harness import run_on_ranks

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
             make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)


def _plain_rms_norm(x, weight, eps):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_backward_equals_autograd_of_the_formula(dtype, tol):
    from ds_megatron.transformer.norm import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(40, 3, 96, dtype=dtype, requires_grad=True)
    grad = torch.randn(40, 3, 96, dtype=dtype)
    out = norm(x)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    ref = _plain_rms_norm(x_ref, w_ref, 1e-5)
    ref.backward(grad)
    assert torch.equal(out, ref)
    for ours, theirs in ((x.grad, x_ref.grad), (norm.weight.grad, w_ref.grad)):
        assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= tol


def _model_saved_bytes(extra, dtype_name):
    """Bytes of the distinct storages a GPT's forward leaves saved for backward (parameters excluded)."""
    from ds_megatron.models import GPTConfig, GPTModel
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    state = ParallelState.build(ParallelLayout(world_size=1))
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**MODEL, **extra}), state)
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, 256, (4, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(1))
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    loss.backward()
    state.destroy()
    return sum(storage.nbytes() for storage in storages.values())


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_rms_norm_and_rope_keep_what_layer_norm_and_learned_positions_keep(dtype_name):
    base, rms, rope, both = run_on_ranks(1, _saved_all, dtype_name)[0]
    sbh = MODEL["seq_length"] * 4 * MODEL["hidden_size"] * (4 if dtype_name == "fp32" else 2)
    # RMSNorm keeps a float32 1/rms per token and norm (5 norms); RoPE its cos and sin tables [s, head_dim] (at
    # most one pair per layer for q and for k: 16-bit casts), nothing of [s, b, h] size.
    tables = MODEL["num_layers"] * 4 * MODEL["seq_length"] * MODEL["hidden_size"] // MODEL["num_attention_heads"] * 4
    for name, got in (("RMSNorm", rms), ("RoPE", rope), ("RoPE + RMSNorm", both)):
        assert abs(got - base) < 0.25 * sbh + tables, (name, got, base, sbh)


def _saved_all(dtype_name):
    return [_model_saved_bytes(extra, dtype_name) for extra in (
        {}, {"normalization": "RMSNorm"}, {"position_embedding_type": "rope"},
        {"position_embedding_type": "rope", "normalization": "RMSNorm"})]
