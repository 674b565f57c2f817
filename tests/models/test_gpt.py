"""GPTModel with TP=2 and 4 (with and without sequence parallelism) against the same model on one rank."""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel import allreduce_tp_partial_grads

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
           vocab_size=300, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG["vocab_size"], (3, CFG["seq_length"]), generator=g)
    labels = torch.randint(0, CFG["vocab_size"], (3, CFG["seq_length"]), generator=g)
    mask = (torch.rand(3, CFG["seq_length"], generator=g) > 0.2).double()
    return tokens, labels, mask


def _full(param, group, world):
    """The full tensor of a TP-split parameter (gathered along its partition dim)."""
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(world)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _loss_and_full_grads(model, group, world):
    tokens, labels, mask = _batch()
    loss = model(tokens, labels, mask)
    loss.backward()
    # Sequence-parallel grads are partial over TP until the step's gradient sync completes them
    # (finalize_model_grads on the Megatron path): the same call here.
    allreduce_tp_partial_grads(model, model.tp)
    grads, weights = {}, {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        gp = torch.nn.Parameter(g.clone())
        for a in ("tensor_model_parallel", "partition_dim"):
            if hasattr(p, a):
                setattr(gp, a, getattr(p, a))
        grads[name] = _full(gp, group, world)
        weights[name] = _full(p, group, world)
        if name == "word_embeddings.weight":  # compare real vocab rows only
            grads[name] = grads[name][:CFG["vocab_size"]]
            weights[name] = weights[name][:CFG["vocab_size"]]
    return loss.detach(), weights, grads


def _compare_tp_with_single_rank(tp, sequence_parallel):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    torch.manual_seed(1234)
    model = GPTModel(GPTConfig(**CFG, sequence_parallel=sequence_parallel), state).double()
    loss, weights, grads = _loss_and_full_grads(model, state.tp.group, tp)
    torch.manual_seed(1234)
    ref = GPTModel(GPTConfig(**CFG)).double()
    ref_loss, ref_weights, ref_grads = _loss_and_full_grads(ref, None, 1)
    state.destroy()
    assert set(weights) == set(ref_weights)
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), f"init of {name} depends on TP size"
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-9, atol=1e-11), name
    assert torch.allclose(loss, ref_loss, rtol=1e-12), (loss, ref_loss)
    return float(loss)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_loss_and_full_gradients_match_single_rank(tp, sp):
    losses = run_on_ranks(4, _compare_tp_with_single_rank, tp, sp)
    assert len(set(losses)) == 1


def test_heads_and_ffn_must_divide_by_tp():
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"):
        GPTConfig(**CFG).check_tensor_parallel(3)
    with pytest.raises(ConfigError, match="ffn_hidden_size=66 is not divisible by tensor_model_parallel_size=4"):
        GPTConfig(**{**CFG, "ffn_hidden_size": 66}).check_tensor_parallel(4)


def test_padding_logits_never_win():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG)).eval()
    assert model.padded_vocab_size == 304
    tokens, _, _ = _batch()
    logits = model(tokens)
    assert logits.shape[-1] == 304
    probs = torch.softmax(logits.masked_fill(torch.arange(304) >= 300, float("-inf")), -1)
    # The padded rows are zero, so their logits are exactly 0; the loss path masks them out.
    assert torch.all(logits[..., 300:] == 0)
    assert torch.all(probs[..., 300:] == 0)


def _recompute_vs_plain(tp):
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    cfg = dict(CFG, hidden_dropout=0.2, attention_dropout=0.2)
    results = []
    for recompute in (None, "full"):
        tracker = model_parallel_seed(77, state.tp.rank, tracker=RNGStatesTracker())
        model = GPTModel(GPTConfig(**cfg, recompute_granularity=recompute), state, rng_tracker=tracker).double()
        tokens, labels, mask = _batch()
        loss = model(tokens, labels, mask)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain), (re_loss, re) = results
    state.destroy()
    # Dropout on, inside and outside TP regions: the recomputed forward must replay the same masks.
    assert torch.equal(plain_loss, re_loss)
    for name in plain:
        assert torch.allclose(plain[name], re[name], rtol=1e-10, atol=1e-12), name
    return float(plain_loss)


def test_full_activation_recomputation_gives_the_same_loss_and_gradients_with_dropout():
    run_on_ranks(4, _recompute_vs_plain, 2)


@pytest.mark.parametrize("kwargs,field", [
    (dict(recompute_granularity="partial"), "model.recompute_granularity='partial'"),
    (dict(recompute_modules=["mlp"]), "model.recompute_modules"),
    (dict(recompute_granularity="selective", recompute_modules=["attn"]), "'attn' is unknown"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "'moe_act' is not supported"),
    (dict(recompute_granularity="selective", recompute_method="block"), "model.recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block"), "needs model.recompute_num_layers"),
    (dict(recompute_granularity="full", recompute_num_layers=2), "recompute_method \"uniform\""),
])
def test_recompute_settings_are_checked(kwargs, field):
    with pytest.raises(ConfigError) as err:
        GPTConfig(**CFG, **kwargs)
    assert field in str(err.value) and "\n" not in str(err.value)


def _grads_and_reruns(**recompute):
    """Loss, gradients and how often each recomputable module ran, for a float64 GPT with dropout (the
    tracker's streams and the default generator drive it) after one forward and backward."""
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    torch.manual_seed(3)
    cfg = GPTConfig(**dict(CFG, hidden_dropout=0.1, attention_dropout=0.1, num_layers=3), **recompute)
    tracker = RNGStatesTracker()
    model = GPTModel(cfg, ParallelState.single(), rng_tracker=tracker).double()
    model_parallel_seed(5, 0, tracker=tracker)
    runs = {"core": 0, "mlp": 0, "norm": 0, "layer": 0}

    def counter(key):
        def hook(*_):
            runs[key] += 1
        return hook
    for layer in model.layers:
        layer.register_forward_pre_hook(counter("layer"))
        layer.mlp.register_forward_pre_hook(counter("mlp"))
        layer.input_layernorm.register_forward_pre_hook(counter("norm"))
        attn = layer.self_attention
        core = attn._core
        attn._core = lambda *a, core=core: (counter("core")(), core(*a))[1]
    torch.manual_seed(11)
    tokens, labels, mask = _batch()
    loss = model(tokens, labels, mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, runs


@pytest.mark.parametrize("recompute,reruns", [
    (dict(recompute_granularity="selective"), {"core": 3}),  # Megatron's default: core_attn
    (dict(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]), {"mlp": 3, "norm": 3}),
    (dict(recompute_granularity="full"), {"core": 3, "mlp": 3, "norm": 3, "layer": 0}),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
     {"core": 2, "mlp": 2, "norm": 2}),
])
def test_recomputation_reruns_what_it_names_and_keeps_the_gradients(recompute, reruns):
    """Every recomputation setting gives the loss and gradients of no recomputation bit for bit (float64, with
    attention and hidden dropout replayed), and reruns exactly the named modules in backward."""
    ref_loss, ref_grads, ref_runs = _grads_and_reruns()
    loss, grads, runs = _grads_and_reruns(**recompute)
    assert torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name
    extra = {k: runs[k] - ref_runs[k] for k in runs}
    assert extra == {**{k: 0 for k in runs}, **reruns}, extra


def test_the_kept_logits_buffer_gives_the_logits_path_loss_and_gradients_step_after_step():
    """Logits of 32 MiB or more on a CPU go into the model's buffer (reused from step to step): the loss and every
    gradient equal F.cross_entropy over the logits the model returns without labels (float64)."""
    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=256, vocab_size=8192,
                    hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(cfg).double()
    g = torch.Generator().manual_seed(3)
    storage = set()
    for _ in range(2):
        tokens, labels = (torch.randint(0, cfg.vocab_size, (4, cfg.seq_length), generator=g) for _ in range(2))
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens).reshape(-1, cfg.vocab_size), labels.reshape(-1)).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        loss = model(tokens, labels)
        loss.backward()
        storage.add(model.logits_buffer._tensor.data_ptr())  # 1024 tokens x 8192 x 8 bytes: kept
        ref = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, cfg.vocab_size), labels.reshape(-1))
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    assert len(storage) == 1
