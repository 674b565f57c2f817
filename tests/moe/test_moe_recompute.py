"""Activation recomputation of MoE GPTs (full, selective "moe") against the same model without it, float64.

A recomputed layer routes again in backward: the loss and every gradient (routing losses included) must be the
run's without recomputation bit for bit (the same process runs the same float64 kernels in the same order: the
rerun only refills the saved tensors of the forward's own graph), the dropout masks replayed, and the rerun must
leave no trace of its own: the tracker's records (what the log averages) and the expert-bias token counts are the
forward's, once.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import moe_config
from ds_megatron.config import ConfigError
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed

# Dense layer 1 between MoE layers 0 and 2, a shared expert, both routing losses, dropout everywhere.
KW = dict(num_layers=3, moe_layer_freq=[1, 0, 1], moe_shared_expert_ffn_hidden_size=16, moe_aux_loss_coeff=0.01,
          moe_z_loss_coeff=0.001, hidden_dropout=0.1, attention_dropout=0.1)
BIAS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
RECOMPUTE = {"none": {}, "full": dict(recompute_granularity="full"),
             "moe": dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"]),
             "block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)}
# Router runs in backward per setting: every MoE layer of a recomputed layer reruns its router once.
RERUNS = {"none": 0, "full": 2, "moe": 2, "block": 1}


def _step(state, recompute, **extra):
    """One float64 forward and backward; (loss, gradients, tracker records, expert-bias counts, router reruns)."""
    torch.manual_seed(21)
    cfg = moe_config(**KW, **RECOMPUTE[recompute], **extra)
    tracker = RNGStatesTracker()
    model = GPTModel(cfg, state, rng_tracker=tracker).double()
    model_parallel_seed(5, state.tp.rank, ep_rank=state.ep.rank, etp_rank=state.etp.rank, tracker=tracker)
    routers = [layer.mlp.router for layer in model.layers if hasattr(layer.mlp, "router")]
    calls = [0]
    for router in routers:
        router.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(100 + state.dp.rank)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    loss = model(tokens, labels)
    forward_calls = calls[0]
    kept = [dict(router.aux_losses) for router in routers]
    loss.backward()
    # A rerun's routing losses are not kept in place of the forward's (they would hold the rerun's graph).
    assert all(router.aux_losses.keys() == losses.keys() and all(router.aux_losses[k] is v for k, v in
               losses.items()) for router, losses in zip(routers, kept)), recompute
    aux = model.moe_aux_loss_tracker
    # What the log shows, and how many records made it (the means hide a value recorded twice).
    records = {key: count for key, (_, count) in aux._sums.items()}
    logged = {name: float(v) for name, v in aux.averages().items()}
    counts = [r.local_tokens_per_expert.clone() for r in routers if r.local_tokens_per_expert is not None]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, records, logged, counts, calls[0] - forward_calls


def _compare(state, recompute, **extra):
    ref_loss, ref_grads, ref_records, ref_logged, ref_counts, _ = _step(state, "none", **extra)
    loss, grads, records, logged, counts, reruns = _step(state, recompute, **extra)
    what = f"{recompute} {extra}"
    assert torch.equal(loss, ref_loss), what
    assert grads.keys() == ref_grads.keys(), what
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), (what, name)
    assert any("router" in name and grad.abs().sum() > 0 for name, grad in grads.items()), what
    assert records == ref_records and set(records.values()) == {1}, (what, records)
    assert logged == ref_logged and ref_logged, what
    assert len(counts) == len(ref_counts) and all(torch.equal(a, b) for a, b in zip(counts, ref_counts)), what
    assert reruns == RERUNS[recompute], (what, reruns)


@pytest.mark.parametrize("recompute", ["full", "moe", "block"])
@pytest.mark.parametrize("grouped", [False, True])
def test_recomputed_moe_gpt_equals_the_stored_one(recompute, grouped):
    """One rank: sequential and grouped experts, softmax routing with both losses and sigmoid routing with the
    expert bias's token counts."""
    state = ParallelState.single()
    _compare(state, recompute, moe_grouped_gemm=grouped)
    _compare(state, recompute, moe_grouped_gemm=grouped, **BIAS)


# The Hugging Face families' MoE pieces: DeepSeek-V3's (MLA, group-limited sigmoid routing with the expert bias and
# top-k scaling, the sequence-wise loss, a multi-token-prediction depth of the MoE kind) and gpt-oss's (sinks,
# windows, biased experts with the clamped quick-GELU GLU, pre-softmax routing).
FAMILIES = {
    "deepseek-v3": dict(BIAS, position_embedding_type="rope", normalization="RMSNorm", multi_latent_attention=True,
                        q_lora_rank=8, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
                        gated_linear_unit=True, activation="silu", moe_router_num_groups=2, moe_router_group_topk=1,
                        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
                        mtp_num_layers=1),
    "gpt-oss": dict(position_embedding_type="rope", normalization="RMSNorm", softmax_type="learnable",
                    window_size=[3, 0], window_attn_skip_freq=[1, 0, 1], gated_linear_unit=True,
                    activation="quick_gelu", activation_func_clamp_value=0.3, glu_linear_offset=1.0,
                    moe_add_bias_linear=True, moe_router_pre_softmax=True),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recomputed_family_layers_equal_the_stored_ones(family):
    _compare(ParallelState.single(), "full", **FAMILIES[family])


def _expert_parallel(ep, etp, tp, extra):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp))
    try:
        for recompute in ("full", "moe"):
            _compare(state, recompute, **extra)
            _compare(state, recompute, moe_grouped_gemm=True, **BIAS, **extra)
    finally:
        state.destroy()


@pytest.mark.parametrize("ep,etp,tp,extra", [
    (2, 1, 1, {}), (1, 2, 1, {}),
    (2, 1, 1, dict(moe_token_dispatcher_type="allgather", moe_capacity_factor=1.0,
                   moe_pad_expert_input_to_capacity=True)),
    (2, 1, 2, dict(sequence_parallel=True))], ids=["ep2", "etp2", "ep2-allgather-capacity", "tp2-sp-ep2"])
def test_recomputed_moe_gpt_equals_the_stored_one_with_expert_parallelism(ep, etp, tp, extra):
    """Two gloo ranks: EP 2 (the rerun's all-to-alls), ETP 2, the all-gather dispatcher with dropping and padding
    to capacity, TP 2 with sequence parallelism over EP 2."""
    run_on_ranks(2, _expert_parallel, ep, etp, tp, extra)


@pytest.mark.parametrize("modules,entry", [(["moe_act"], "'moe_act'"), (["mla_up_proj"], "'mla_up_proj'")])
def test_unbuilt_recompute_modules_are_refused(modules, entry):
    with pytest.raises(ConfigError) as err:
        moe_config(recompute_granularity="selective", recompute_modules=modules)
    assert entry in str(err.value) and "\n" not in str(err.value)


def test_the_plan_and_cuda_graphs_refuse_what_they_do_not_model_of_recomputed_moe_layers_in_one_line():
    """What is not built for recomputed MoE layers is refused at start: graph capture; the activation plan with the
    all-gather dispatcher or fp8 experts (the all-to-all dispatcher's 16-bit experts are planned:
    tests/optimizer/test_planning.py)."""
    from ds_megatron.config.cuda_graph import CudaGraphConfig
    from ds_megatron.planning import activation_bytes
    graphs = CudaGraphConfig(impl="transformer_engine", scope=["attn", "moe_router"])
    for recompute in ("full", "moe", "block"):
        cfg = moe_config(**RECOMPUTE[recompute])
        activation_bytes(cfg, 1, 1, "fp32")
        for check, field in ((lambda: graphs.check_moe_settings(cfg), "cuda_graph.impl"),
                             (lambda: activation_bytes(moe_config(moe_token_dispatcher_type="allgather",
                                                                  **RECOMPUTE[recompute]), 1, 1, "fp32"),
                              "model.moe_token_dispatcher_type"),
                             (lambda: activation_bytes(moe_config(fp8="e4m3", **RECOMPUTE[recompute]), 1, 1,
                                                       "bf16"), "model.fp8")):
            with pytest.raises(ConfigError) as err:
                check()
            assert field in str(err.value) and "\n" not in str(err.value), recompute
    graphs.check_moe_settings(moe_config(recompute_granularity="selective"))  # core_attn: MoE layers not rerun
    activation_bytes(moe_config(fp8="e4m3", recompute_granularity="selective"), 1, 1, "bf16")
    activation_bytes(moe_config(), 1, 1, "fp32")


def test_the_communication_plan_counts_the_reruns_of_moe_layers():
    """A recomputed MoE layer's rerun exchanges its tokens again: the plan's EP bytes grow by it (to the byte against
    real steps in tests/test_bytes_on_wire.py); selective core_attn alone reruns no MoE layer."""
    from ds_megatron.planning import plan_comm_volume
    layout = ParallelLayout(world_size=2, ep=2)
    ep = {recompute: plan_comm_volume(moe_config(**RECOMPUTE[recompute]), layout, "fp32", 1, 1)[0].bus_bytes["ep"]
          for recompute in ("full", "moe", "block")}
    plain = plan_comm_volume(moe_config(), layout, "fp32", 1, 1)[0].bus_bytes["ep"]
    core = plan_comm_volume(moe_config(recompute_granularity="selective"), layout, "fp32", 1, 1)[0].bus_bytes["ep"]
    assert core == plain and all(nbytes > plain for nbytes in ep.values()), (plain, core, ep)
