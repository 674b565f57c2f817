"""The architecture options (RoPE, RMSNorm, SwiGLU, GQA, qk norm, untied output, no biases) at TP=2 and 4.

Loss and every full gradient equal the one-rank model's (same seed, float64).
At TP=4 with 2 query groups each KV head lives on two TP ranks: both copies must
get the full gradient (the sum of both ranks' query heads) and stay identical.
Full tensors are put back together with the converter's own mapping, which
also checks that replicated copies agree.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.convert.mapping import Layout, Mapping
from ds_megatron.convert.model_io import model_tensors
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads

LLAMA_LIKE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  seq_length=16, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0,
                  position_embedding_type="rope", rotary_base=500.0, normalization="RMSNorm", gated_linear_unit=True,
                  activation="silu", add_bias_linear=False, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
                  qk_layernorm=True, make_vocab_size_divisible_by=8)


def _batch():
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, 100, (2, 16), generator=g), torch.randint(0, 100, (2, 16), generator=g))


def _local_grads(tp, sp, extra):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    torch.manual_seed(11)
    model = GPTModel(GPTConfig(**{**LLAMA_LIKE, **extra}, sequence_parallel=sp), state).double()
    tokens, labels = _batch()
    loss = model(tokens, labels)
    loss.backward()
    allreduce_tp_partial_grads(model, state.tp)  # what finalize_model_grads does in a step
    grads = {name: t.grad.clone() for name, t in model_tensors(model).items()}
    weights = {name: t.detach().clone() for name, t in model_tensors(model).items()}
    tp_rank = state.tp.rank
    state.destroy()
    return float(loss.detach()), tp_rank, weights, grads


def _full(per_rank, config, tp):
    """HF-named full tensors from each TP rank's tensors (replicated copies must be equal)."""
    mapping = Mapping("llama", config, Layout.uniform(config.num_layers, tp=tp))
    shapes, out, seen = mapping.hf_shapes(), {}, set()
    for t_rank, tensors in per_rank.items():
        for target in mapping.dense_targets(0, t_rank):
            offset = 0
            for p in target.pieces:
                block = tensors[target.name][offset:offset + p.num_rows]
                offset += p.num_rows
                if p.source is None:
                    continue
                full = out.setdefault(p.source, torch.full(shapes[p.source], float("nan"), dtype=torch.float64))
                region = full[p.rows[0]:p.rows[1]]
                region = region if p.cols is None else region[:, p.cols[0]:p.cols[1]]
                key = (p.source, p.rows, p.cols)
                if key in seen:
                    assert torch.equal(region, block), f"replicated copies of {p.source} differ"
                seen.add(key)
                region.copy_(block)
    assert all(not torch.isnan(v).any() for v in out.values())
    return out


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
@pytest.mark.parametrize("extra", [{}, {"num_query_groups": 1, "kv_channels": 16, "rotary_percent": 0.5}])
def test_options_match_one_rank(tp, sp, extra):
    config = GPTConfig(**{**LLAMA_LIKE, **extra})
    results = run_on_ranks(4, _local_grads, tp, sp, extra)
    ref_loss, _, ref_w, ref_g = run_on_ranks(4, _local_grads, 1, False, extra)[0]
    ranks = {r[1]: r for r in results[:tp]}
    assert all(abs(r[0] - ref_loss) < 1e-12 * abs(ref_loss) for r in results)
    weights = _full({t: r[2] for t, r in ranks.items()}, config, tp)
    grads = _full({t: r[3] for t, r in ranks.items()}, config, tp)
    ref_weights, ref_grads = _full({0: ref_w}, config, 1), _full({0: ref_g}, config, 1)
    for name in ref_grads:
        assert torch.equal(weights[name], ref_weights[name]), f"init of {name} depends on TP"
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-10, atol=1e-13), name


def test_invalid_combinations_fail_at_config_time():
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by model.num_query_groups=3"):
        GPTConfig(**{**LLAMA_LIKE, "num_query_groups": 3})
    with pytest.raises(ConfigError, match=r"rotary_percent=1.5 is outside \(0, 1\]"):
        GPTConfig(**{**LLAMA_LIKE, "rotary_percent": 1.5})
    with pytest.raises(ConfigError, match="RoPE rotates pairs"):
        GPTConfig(**{**LLAMA_LIKE, "hidden_size": 36, "num_attention_heads": 4, "num_query_groups": 4})
    with pytest.raises(ConfigError, match="num_query_groups=2 and tensor_model_parallel_size=3"):
        GPTConfig(**{**LLAMA_LIKE, "num_attention_heads": 6, "hidden_size": 48}).check_tensor_parallel(3)
    with pytest.raises(ConfigError, match="model.normalization='rms' is unknown"):
        GPTConfig(**{**LLAMA_LIKE, "normalization": "rms"})
    with pytest.raises(ConfigError, match="layernorm_epsilon=0.001 and model.norm_epsilon=1e-06 disagree"):
        GPTConfig(norm_epsilon=1e-6, layernorm_epsilon=1e-3)
