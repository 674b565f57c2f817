"""TP layers against a dense float64 reference on one process: same seed ->
same full weights -> plain torch ops.  Checks outputs, input grads and each
rank's slice of the weight and bias grads."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_on_ranks
from ds_megatron.parallel_state import ParallelGroup
from tp_helpers import SEED, STD, all_gather_cat, close, dense_weight, part, randn, tp_group
from ds_megatron.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                         allreduce_tp_partial_grads, init_method_normal)

S, B, IN, OUT = 4, 2, 8, 12
F64 = dict(params_dtype=torch.float64, init_method=init_method_normal(STD))


def _dense_linear(W, b, X, G):
    """Dense forward and grads of loss = sum(Y * G)."""
    Wd, bd, Xd = (t.clone().requires_grad_() for t in (W, b, X))
    Y = F.linear(Xd, Wd, bd)
    (Y * G).sum().backward()
    return Y.detach(), Xd.grad, Wd.grad, bd.grad


def _column(tp, gather_output, skip_bias_add):
    with tp_group(tp) as (g, r, n):
        torch.manual_seed(SEED)
        layer = ColumnParallelLinear(IN, OUT, tp=g, gather_output=gather_output,
                                     skip_bias_add=skip_bias_add, **F64)
        W, b, X, G = dense_weight(SEED, OUT, IN), randn(1, OUT), randn(2, S, B, IN), randn(3, S, B, OUT)
        with torch.no_grad():
            layer.bias.copy_(part(b, 0, r, n))  # biases start at zero; make them matter
        Y, dX, dW, db = _dense_linear(W, b, X, G)

        assert layer.weight.shape == (OUT // n, IN) and layer.weight.partition_dim == 0
        assert layer.weight.tensor_model_parallel and layer.bias.tensor_model_parallel
        x = X.clone().requires_grad_()
        out, out_bias = layer(x)
        if skip_bias_add:
            assert out_bias is layer.bias
            close(out, part(Y - b, -1, r, n), "column output without bias")
            out = out + out_bias
        else:
            assert out_bias is None
        if gather_output:
            close(out, Y, "gathered column output")
            (out * G).sum().backward()
        else:
            close(out, part(Y, -1, r, n), "column output slice")
            (out * part(G, -1, r, n)).sum().backward()
        close(x.grad, dX, "column input grad (all-reduced)")
        close(layer.weight.grad, part(dW, 0, r, n), "column weight grad slice")
        close(layer.bias.grad, part(db, 0, r, n), "column bias grad slice")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gather_output,skip_bias_add", [(False, False), (True, False), (False, True)])
def test_column_parallel_linear_matches_dense(tp, gather_output, skip_bias_add):
    run_on_ranks(tp, _column, tp, gather_output, skip_bias_add)


def _row(tp, input_is_parallel, skip_bias_add):
    with tp_group(tp) as (g, r, n):
        torch.manual_seed(SEED)
        layer = RowParallelLinear(IN, OUT, tp=g, input_is_parallel=input_is_parallel,
                                  skip_bias_add=skip_bias_add, **F64)
        W, b, X, G = dense_weight(SEED, OUT, IN), randn(1, OUT), randn(2, S, B, IN), randn(3, S, B, OUT)
        with torch.no_grad():
            layer.bias.copy_(b)
        Y, dX, dW, db = _dense_linear(W, b, X, G)

        assert layer.weight.shape == (OUT, IN // n) and layer.weight.partition_dim == 1
        assert not layer.bias.tensor_model_parallel and not layer.bias.sequence_parallel
        x = (part(X, -1, r, n) if input_is_parallel else X).clone().requires_grad_()
        out, out_bias = layer(x)
        if skip_bias_add:
            assert out_bias is layer.bias
            close(out, Y - b, "row output without bias (bias must be added once, by the caller)")
            out = out + out_bias
        else:
            assert out_bias is None
        close(out, Y, "row output")
        (out * G).sum().backward()
        close(x.grad, part(dX, -1, r, n) if input_is_parallel else dX, "row input grad")
        close(layer.weight.grad, part(dW, 1, r, n), "row weight grad slice")
        close(layer.bias.grad, db, "row bias grad")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("input_is_parallel,skip_bias_add", [(True, False), (False, False), (True, True)])
def test_row_parallel_linear_matches_dense(tp, input_is_parallel, skip_bias_add):
    run_on_ranks(tp, _row, tp, input_is_parallel, skip_bias_add)


def _mlp(tp, sequence_parallel):
    """Column -> GeLU -> Row (the paper's MLP), with or without sequence parallelism."""
    H, FF = IN, 2 * OUT
    with tp_group(tp) as (g, r, n):
        torch.manual_seed(SEED)
        fc1 = ColumnParallelLinear(H, FF, tp=g, sequence_parallel=sequence_parallel, **F64)
        torch.manual_seed(SEED + 1)
        fc2 = RowParallelLinear(FF, H, tp=g, input_is_parallel=True, sequence_parallel=sequence_parallel,
                                **F64)
        mlp = torch.nn.ModuleList([fc1, fc2])
        W1, W2 = dense_weight(SEED, FF, H), dense_weight(SEED + 1, H, FF)
        b1, b2, X, G = randn(1, FF), randn(2, H), randn(3, S, B, H), randn(4, S, B, H)
        with torch.no_grad():
            fc1.bias.copy_(part(b1, 0, r, n))
            fc2.bias.copy_(b2)

        dense = [t.clone().requires_grad_() for t in (W1, b1, W2, b2, X)]
        dW1, db1, dW2, db2, dX = dense
        Y = F.linear(F.gelu(F.linear(dX, dW1, db1)), dW2, db2)
        (Y * G).sum().backward()

        if sequence_parallel:
            x = part(X, 0, r, n).clone().requires_grad_()
            want_y, want_dx, g_out = part(Y, 0, r, n), part(dX.grad, 0, r, n), part(G, 0, r, n)
        else:
            x = X.clone().requires_grad_()
            want_y, want_dx, g_out = Y, dX.grad, G
        h, _ = fc1(x)
        out, _ = fc2(F.gelu(h))
        close(out, want_y.detach(), "MLP output")
        (out * g_out).sum().backward()
        assert fc2.bias.sequence_parallel is sequence_parallel
        if sequence_parallel:
            # Each rank's bias grad covers only its tokens until summed over TP.
            partial = fc2.bias.grad.clone()
            close(all_gather_cat(partial[None], g, 0).sum(0), db2.grad, "row bias grad partial sums")
            assert not torch.allclose(partial, db2.grad)
        assert allreduce_tp_partial_grads(mlp, g) == (1 if sequence_parallel else 0)
        close(x.grad, want_dx, "MLP input grad")
        close(fc1.weight.grad, part(dW1.grad, 0, r, n), "fc1 weight grad slice")
        close(fc1.bias.grad, part(db1.grad, 0, r, n), "fc1 bias grad slice")
        close(fc2.weight.grad, part(dW2.grad, 1, r, n), "fc2 weight grad slice")
        close(fc2.bias.grad, db2.grad, "fc2 bias grad")


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_with_and_without_sequence_parallel_matches_dense(world, tp, sequence_parallel):
    run_on_ranks(world, _mlp, tp, sequence_parallel)


V, HID = 16, 6


def _embedding(tp, reduce_scatter_embeddings):
    with tp_group(tp) as (g, r, n):
        torch.manual_seed(SEED)
        emb = VocabParallelEmbedding(V, HID, tp=g, reduce_scatter_embeddings=reduce_scatter_embeddings, **F64)
        assert (emb.vocab_start_index, emb.vocab_end_index) == (r * V // n, (r + 1) * V // n)
        W = dense_weight(SEED, V, HID)
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
        ids[0, :4] = torch.tensor([0, V - 1, V // 2 - 1, V // 2])  # range edges
        G = randn(6, B, S, HID)
        Wd = W.clone().requires_grad_()
        E = F.embedding(ids, Wd)
        (E * G).sum().backward()

        out = emb(ids)
        if reduce_scatter_embeddings:
            # Megatron's sequence-parallel layout: [s/tp, b, h].
            want, g_out = part(E.detach().transpose(0, 1), 0, r, n), part(G.transpose(0, 1), 0, r, n)
        else:
            want, g_out = E.detach(), G
        close(out, want, "embedding output")
        (out * g_out).sum().backward()
        close(emb.weight.grad, part(Wd.grad, 0, r, n), "embedding weight grad slice")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduce_scatter_embeddings", [False, True])
def test_vocab_parallel_embedding_matches_dense(tp, reduce_scatter_embeddings):
    run_on_ranks(tp, _embedding, tp, reduce_scatter_embeddings)


def _full_weights(tp):
    """Every layer's full weight, gathered over a TP group of size ``tp`` (a group of one: TP=1)."""
    def build_and_gather(g):
        torch.manual_seed(SEED)
        col = ColumnParallelLinear(IN, OUT, tp=g)
        row = RowParallelLinear(OUT, IN, tp=g)
        emb = VocabParallelEmbedding(V, HID, tp=g)
        if g.size == 1:
            return [col.weight, row.weight, emb.weight]
        return [all_gather_cat(col.weight.detach(), g, 0), all_gather_cat(row.weight.detach(), g, 1),
                all_gather_cat(emb.weight.detach(), g, 0)]
    if tp == 1:
        return [w.detach() for w in build_and_gather(ParallelGroup.single("tp"))]
    with tp_group(tp) as (g, _, _):
        return build_and_gather(g)


def _init_independent_of_tp():
    ref = _full_weights(1)
    torch.manual_seed(SEED)
    first = torch.empty(OUT, IN)
    torch.nn.init.normal_(first, std=0.02)  # default init_method: N(0, 0.02)
    assert torch.equal(ref[0], first), "TP=1 column weight is not the single-rank draw"
    for tp in (2, 4):
        for name, a, b in zip(("column", "row", "embedding"), _full_weights(tp), ref):
            assert torch.equal(a, b), f"{name} weight at TP={tp} differs from TP=1"


def test_initialization_is_independent_of_tp_size():
    run_on_ranks(4, _init_independent_of_tp)


def _bad_configs():
    with tp_group(dist.get_world_size()) as (g, _, n):
        with pytest.raises(ValueError, match=r"ColumnParallelLinear output_size=10 is not divisible by 4;"):
            ColumnParallelLinear(IN, 10, tp=g)
        with pytest.raises(ValueError, match="gather_output=True cannot be combined"):
            ColumnParallelLinear(IN, OUT, tp=g, gather_output=True, sequence_parallel=True)
        with pytest.raises(ValueError, match="requires input_is_parallel=True"):
            RowParallelLinear(OUT, IN, tp=g, sequence_parallel=True)
        with pytest.raises(ValueError, match="num_embeddings=18 .* pad_vocab_size"):
            VocabParallelEmbedding(18, HID, tp=g)
        with pytest.raises(ValueError, match="RowParallelLinear input_size=6 is not divisible by 4"):
            RowParallelLinear(6, IN, tp=g)


def test_invalid_configurations_name_the_value_and_the_fix():
    run_on_ranks(4, _bad_configs)


def test_partition_arithmetic():
    from ds_megatron.tensor_parallel import divide, pad_vocab_size, vocab_range_from_global_vocab_size
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by 4"):
        divide(6, 4, what="num_heads")
    assert pad_vocab_size(50257, 128, 8) == 51200  # the paper's GPT-2 figure
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(256, 128, 2) == 256
    assert [vocab_range_from_global_vocab_size(16, r, 4) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(ValueError, match="not divisible by 3"):
        vocab_range_from_global_vocab_size(16, 0, 3)
