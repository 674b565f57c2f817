"""Tiled MLP and tiled loss (``mlp_sequence_tiles`` / ``loss_sequence_tiles``): the same loss and gradients as untiled
(float64, TP = 1 and TP = 2 with sequence parallelism on real gloo ranks), and the [s, ffn] / [s, V/tp] intermediates
one tile at a time (the largest tensor saved for backward or alive at once shrinks with the tiles)."""
import pytest
import torch

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.models import GPTConfig, GPTModel

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=32, vocab_size=512,
           hidden_dropout=0.1, attention_dropout=0.0, make_vocab_size_divisible_by=8, untie_embeddings_and_output_weights=False)


def _loss_grads_and_largest(tp, sp, untied, **tiles):
    import torch.distributed as dist
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel import RNGStatesTracker, allreduce_tp_partial_grads, model_parallel_seed
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    torch.manual_seed(3)
    tracker = RNGStatesTracker()
    cfg = GPTConfig(**dict(CFG, untie_embeddings_and_output_weights=untied), sequence_parallel=sp, **tiles)
    model = GPTModel(cfg, state, rng_tracker=tracker).double()
    model_parallel_seed(5, state.tp.rank, tracker=tracker)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"] + 1), generator=g)
    mask = (torch.rand(2, CFG["seq_length"], generator=g) > 0.3).double()
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel())
        return t
    torch.manual_seed(11)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:], mask)
    loss.backward()
    allreduce_tp_partial_grads(model, model.tp)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state.destroy()
    return loss.detach(), grads, largest[0]


@pytest.mark.parametrize("tp,sp,untied", [(1, False, False), (1, False, True), (2, True, False)],
                         ids=["tp1", "tp1-untied", "tp2-sp"])
def test_tiles_give_the_untiled_loss_and_gradients_with_smaller_saved_tensors(tp, sp, untied):
    plain = run_on_ranks(tp, _loss_grads_and_largest, tp, sp, untied)
    tiled = run_on_ranks(tp, _loss_grads_and_largest, tp, sp, untied, mlp_sequence_tiles=4, loss_sequence_tiles=4)
    for (loss, grads, largest), (t_loss, t_grads, t_largest) in zip(plain, tiled):
        assert torch.allclose(t_loss, loss, rtol=1e-12, atol=0)
        for name, grad in grads.items():
            assert torch.allclose(t_grads[name], grad, rtol=1e-10, atol=1e-14), name
        # Untied: the [s, b, V/tp] logits are the largest saved tensor; tied: they are never saved (the fused
        # loss), so the [s, b, ffn] MLP intermediate is: a quarter of either with 4 tiles.
        assert t_largest <= largest // 2, (t_largest, largest)


def test_tile_settings_are_checked():
    for kwargs, field in ((dict(mlp_sequence_tiles=0), "model.mlp_sequence_tiles"),
                          (dict(loss_sequence_tiles=1.5), "model.loss_sequence_tiles"),
                          (dict(mlp_sequence_tiles=2, num_experts=2, moe_router_topk=1), "model.mlp_sequence_tiles")):
        with pytest.raises(ConfigError) as err:
            GPTConfig(**CFG, **kwargs)
        assert field in str(err.value) and "\n" not in str(err.value)
