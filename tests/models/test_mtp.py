"""Multi-token prediction (DeepSeek-V3's MTP, megatron-core's layout): the loss is the seed's formula, computed here
by hand in float64 from the model's weights; TP = 2 with sequence parallelism, and with CP = 2 besides, gives the
one-rank loss and gradients;
a torch_dist checkpoint saved at TP = 2 loads at TP = 1 with the same weights; the config refuses what it cannot run."""
import pytest
import torch
import torch.nn.functional as F

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel_state import ParallelState

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16, vocab_size=60,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, normalization="RMSNorm",
           position_embedding_type="rope", mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


def _batch():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, CFG["vocab_size"], (3, CFG["seq_length"] + 1), generator=g)
    mask = (torch.rand(3, CFG["seq_length"], generator=g) > 0.2).double()
    return tokens[:, :-1], tokens[:, 1:], mask


def _masked_ce(hidden, weight, labels, mask):
    logits = (hidden @ weight.t())[..., :CFG["vocab_size"]].transpose(0, 1)  # [b, s, V]
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum() / mask.sum()


def _shift(t, k):
    return torch.cat((t[:, k:], torch.zeros_like(t[:, :k])), dim=1)


def test_loss_is_the_main_loss_plus_the_scaled_mean_of_each_depths_loss():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG)).double()
    tokens, labels, mask = _batch()
    got = model(tokens, labels, mask)
    with torch.no_grad():
        w = model.word_embeddings.weight

        def embed(t):
            return model.position_embeddings(model.word_embeddings(t))
        h = embed(tokens)
        for layer in model.layers:
            h = layer(h)
        h = model.final_layernorm(h)
        expected = _masked_ce(h, w, labels, mask)
        depth_losses = []
        for k, mtp in enumerate(model.mtp, start=1):
            x = F.linear(torch.cat((mtp.enorm(embed(_shift(tokens, k))), mtp.hnorm(h)), dim=-1), mtp.eh_proj.weight)
            h = mtp.final_layernorm(mtp.layer(x))
            depth_losses.append(_masked_ce(h, w, _shift(labels, k), _shift(mask, k)))
        expected = expected + 0.3 * sum(depth_losses) / 2
    assert torch.allclose(got.detach(), expected, rtol=1e-12, atol=0)
    tracked = model.moe_aux_loss_tracker.averages()["mtp_loss"]  # logged beside the main loss: the mean over depths
    assert torch.allclose(tracked, sum(depth_losses) / 2, rtol=1e-12, atol=0)
    got.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())
    # An evaluation's forward (the same loss) is not mixed into the training log's MTP loss.
    model.moe_aux_loss_tracker.reset()
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(tokens, labels, mask), got.detach(), rtol=1e-12, atol=0)
    assert "mtp_loss" not in model.moe_aux_loss_tracker.averages()


def _tp_loss_and_grads(tp, sp, cp=1):
    import torch.distributed as dist
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.tensor_parallel import allreduce_tp_partial_grads
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, cp=cp))
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG, sequence_parallel=sp), state).double()
    loss = model(*_batch())
    loss.backward()
    allreduce_tp_partial_grads(model, model.tp)
    if cp > 1:  # each CP rank's gradient is cp x its share of the sequence's: the job averages over dp-cp
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp.group)
            p.grad /= cp
    out = loss.detach(), {n: _gathered_grad(p, state) for n, p in model.named_parameters()}
    state.destroy()
    return out


def _gathered_grad(p, state):
    import torch.distributed as dist
    g = p.grad.detach()
    if not getattr(p, "tensor_model_parallel", False) or state.tp.size == 1:
        return g
    parts = [torch.empty_like(g) for _ in range(state.tp.size)]
    dist.all_gather(parts, g.contiguous(), group=state.tp.group)
    return torch.cat(parts, dim=p.partition_dim)


@pytest.mark.parametrize("tp,cp", [(2, 1), (2, 2)], ids=["tp2-sp", "tp2-sp-cp2"])
def test_tensor_sequence_and_context_parallel_give_the_one_rank_loss_and_gradients(tp, cp):
    # CP: the tokens and labels k ahead are shifted whole, then cut into each rank's zigzag chunks.
    (loss, grads), = run_on_ranks(1, _tp_loss_and_grads, 1, False)
    for t_loss, t_grads in run_on_ranks(tp * cp, _tp_loss_and_grads, tp, True, cp):
        assert torch.allclose(t_loss, loss, rtol=1e-12, atol=0)
        for name, grad in grads.items():
            got = t_grads[name][:grad.size(0)] if name == "word_embeddings.weight" else t_grads[name]
            assert torch.allclose(got, grad, rtol=1e-9, atol=1e-13), name


def _save_at_tp2_load_at_tp1(directory, tp, ep=1, moe=False, pp=1, pp_model=False):
    """Saved at TP=2 (or with MoE MTP layers at EP=2, or at PP=2: the MTP layers and the embedding's copies on the
    last stage) after a step, loaded at one rank: the MTP weights (at PP=2 the last stage's embedding copies too)."""
    import ds_megatron
    from ds_megatron.convert.model_io import model_tensors
    from ds_megatron.models.gpt_chunks import GPTModelChunks
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2 if pp > 1 else 1,
           "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "megatron": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1,
                        "expert_model_parallel_size": ep, "pipeline_model_parallel_size": pp}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model_cfg = GPTConfig(**{**CFG, **(MOE if moe else {}), **(PP_MODEL if pp_model else {})},
                          sequence_parallel=tp > 1)
    model = GPTModelChunks(model_cfg, state) if pp > 1 else GPTModel(model_cfg, state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    if pp > 1:
        tokens, labels, mask = _batch()
        engine.train_batch(iter([(tokens, (labels, mask.float()))] * 2))
        ds_megatron.save_dist_checkpoint(engine, directory)
    elif tp > 1 or ep > 1:
        tokens, labels, mask = _batch()
        engine.backward(engine(tokens, labels, mask.float()))
        engine.step()
        ds_megatron.save_dist_checkpoint(engine, directory)
    else:
        ds_megatron.load_dist_checkpoint(engine, directory)
    if moe:  # the experts by their global names (each EP rank holds half)
        weights = {n: t.detach().clone() for n, t in model_tensors(model).items() if n.startswith("mtp.")}
    else:
        named = model.named_gpt_parameters() if pp > 1 else model.named_parameters()
        last = pp == 1 or state.pp.rank == pp - 1
        weights = {n: _gathered_param(p, state) for n, p in named
                   if last and n.startswith(("mtp.", "word_embeddings.", "position_embeddings."))}
    engine.megatron.destroy()
    return weights


def _gathered_param(p, state):
    import torch.distributed as dist
    if not getattr(p, "tensor_model_parallel", False) or state.tp.size == 1:
        return p.detach().clone()
    parts = [torch.empty_like(p) for _ in range(state.tp.size)]
    dist.all_gather(parts, p.detach().contiguous(), group=state.tp.group)
    return torch.cat(parts, dim=p.partition_dim)


def test_a_torch_dist_checkpoint_of_the_mtp_layers_moves_between_tensor_parallel_sizes(tmp_path):
    saved = run_on_ranks(2, _save_at_tp2_load_at_tp1, str(tmp_path / "ckpt"), 2)[0]
    loaded = run_on_ranks(1, _save_at_tp2_load_at_tp1, str(tmp_path / "ckpt"), 1)[0]
    assert sorted(saved) == sorted(loaded) and any("eh_proj" in n for n in saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


# At PP = 2: learned positions and an untied output layer, so that both embedding copies on the last stage are
# multi-token prediction's own.
PP_MODEL = dict(position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=True)


def test_a_torch_dist_checkpoint_of_the_last_stages_mtp_layers_loads_without_a_pipeline(tmp_path):
    directory = str(tmp_path / "ckpt_pp")
    saved = run_on_ranks(2, _save_at_tp2_load_at_tp1, directory, 1, 1, False, 2, True)[1]
    loaded = run_on_ranks(1, _save_at_tp2_load_at_tp1, directory, 1, 1, False, 1, True)[0]
    assert sorted(saved) == sorted(loaded) and "position_embeddings.weight" in saved
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_torch_dist_checkpoint_of_moe_mtp_layers_moves_between_expert_parallel_sizes(tmp_path):
    per_rank = run_on_ranks(2, _save_at_tp2_load_at_tp1, str(tmp_path / "ckpt"), 1, 2, True)
    saved = {**per_rank[0], **per_rank[1]}  # each EP rank's experts, under their global names
    loaded = run_on_ranks(1, _save_at_tp2_load_at_tp1, str(tmp_path / "ckpt"), 1, 1, True)[0]
    assert sorted(saved) == sorted(loaded) and any(".mlp.experts.3." in n for n in saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("kwargs,field", [
    (dict(mtp_num_layers=-1), "model.mtp_num_layers"),
    (dict(mtp_loss_scaling_factor=0.0), "model.mtp_loss_scaling_factor"),
])
def test_mtp_settings_are_checked(kwargs, field):
    with pytest.raises(ConfigError) as err:
        GPTConfig(**{**CFG, **kwargs})
    assert field in str(err.value) and "\n" not in str(err.value)


# DeepSeek-V3's shape: a dense first layer, MoE after it; the MTP layers follow the last decoder layer (MoE).
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.01)


def _ep2_loss_and_grads(ep):
    """Both ranks train the same batch: dense gradients equal the one-rank model's, each expert's is the sum of
    both ranks' tokens' (twice the one-rank gradient)."""
    import torch.distributed as dist
    from ds_megatron.parallel.layout import ParallelLayout
    from moe_helpers import expert_grads
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), ep=ep))
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG, **MOE), state).double()
    loss = model(*_batch())
    loss.backward()
    dense = {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." not in n}
    experts = {(name, *key): g.clone() for name, m in model.named_modules() if name.endswith("mlp.experts")
               for key, g in expert_grads(m).items()}
    tracked = model.moe_aux_loss_tracker.per_layer()
    state.destroy()
    return loss.detach(), dense, experts, tracked


def test_moe_mtp_layers_at_ep2_give_the_one_rank_loss_and_gradients():
    cfg = GPTConfig(**CFG, **MOE)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]  # 2 decoder + 2 MTP layers
    (loss, dense, experts, tracked), = run_on_ranks(1, _ep2_loss_and_grads, 1)
    # The MTP layers' routers record their routing losses too (layer numbers 2 and 3), and add them to the loss.
    assert sorted(tracked["load_balancing_loss"]) == [1, 2, 3], tracked
    for e_loss, e_dense, e_experts, _ in run_on_ranks(2, _ep2_loss_and_grads, 2):
        assert torch.allclose(e_loss, loss, rtol=1e-12, atol=0)
        for name, grad in dense.items():
            assert torch.allclose(e_dense[name], grad, rtol=1e-9, atol=1e-13), name
        assert len(e_experts) == len(experts) // 2 and any(k[0].startswith("mtp.") for k in e_experts)
        for key, grad in e_experts.items():
            assert torch.allclose(grad, 2 * experts[key], rtol=1e-9, atol=1e-13), key


def test_the_mtp_layers_routing_losses_reach_their_routers():
    grads = []
    for coeff in (0.0, 0.01):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**CFG, **{**MOE, "moe_aux_loss_coeff": coeff})).double()
        model(*_batch()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if n.endswith("router.weight")})
    assert sorted(grads[0]) == ["layers.1.mlp.router.weight", "mtp.0.layer.mlp.router.weight",
                                "mtp.1.layer.mlp.router.weight"]
    for name, grad in grads[0].items():  # the load-balancing loss adds its gradient to every router
        assert not torch.allclose(grads[1][name], grad, rtol=1e-6, atol=0), name


def test_mtp_with_pipeline_parallelism_needs_our_runtime():
    # On the last stage the MTP layers embed the tokens k ahead: our runtime hands that stage the tokens (trained
    # against PP = 1 in tests/pipeline/test_pipeline_equivalence.py), DeepSpeed's PipelineEngine does not.
    from ds_megatron.config.pipeline import DeepSpeedBatchKeys, check_pipeline
    from ds_megatron.config.parallel import ParallelConfig
    from ds_megatron.parallel.layout import ParallelLayout
    layout = ParallelLayout(world_size=2, pp=2)
    GPTConfig(**CFG).check_layout(layout)
    batch = DeepSpeedBatchKeys(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    check_pipeline(ParallelConfig(pipeline_model_parallel_size=2), GPTConfig(**CFG), batch, layout, "megatron")
    with pytest.raises(ConfigError, match=r'model.mtp_num_layers=2 with megatron.pipeline_model_parallel_size=2 '
                                          r'needs megatron.optimizer_impl "megatron"'):
        check_pipeline(ParallelConfig(pipeline_model_parallel_size=2), GPTConfig(**CFG), batch, layout, "deepspeed")


def test_the_plan_counts_the_mtp_parameters():
    from ds_megatron.planning import gpt_param_counts
    for untied, moe in ((False, {}), (True, {}), (False, MOE)):
        cfg = GPTConfig(**CFG, untie_embeddings_and_output_weights=untied, **moe)
        model = GPTModel(cfg)
        assert gpt_param_counts(cfg, 1).total == sum(p.numel() for p in model.parameters())


def _stage_counts(untied):
    """(the plan's count of this pipeline stage's parameters, the built stage's) at PP = 2, learned positions."""
    import torch.distributed as dist
    from ds_megatron.models.gpt_chunks import GPTModelChunks
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.planning import gpt_param_counts
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), pp=2))
    cfg = GPTConfig(**{**CFG, "position_embedding_type": "learned_absolute"},
                    untie_embeddings_and_output_weights=untied)
    model = GPTModelChunks(cfg, state)
    planned = gpt_param_counts(cfg, 1, layers=model.stage_layers, first_stage=model.is_first_stage,
                               last_stage=model.is_last_stage).total
    built = sum(p.numel() for p in model.parameters())
    state.destroy()
    return planned, built


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_the_plan_counts_the_last_stages_mtp_layers_and_embedding_copies(untied):
    for planned, built in run_on_ranks(2, _stage_counts, untied):
        assert planned == built
