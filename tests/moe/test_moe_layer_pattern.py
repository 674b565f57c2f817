"""Megatron's list form of ``moe_layer_freq`` (dense layers of ``ffn_hidden_size`` among the MoE layers, as in
DeepSeek-V3's dense first layers) with DeepSeek's ungated shared expert: the layers built, the plan's counts, the
pipeline split by parameters, one-line refusals, and float64 SGD at TP=2 + SP, EP=2 following the one-rank model."""
import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from moe_helpers import MOE, moe_config
from ds_megatron.config import ConfigError, ParallelConfig
from ds_megatron.config.model import GPTConfig
from ds_megatron.config.parsing import parse_section
from ds_megatron.models import GPTModel
from ds_megatron.moe.moe_layer import MoELayer
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.planning.param_counts import gpt_param_counts, pipeline_stage_layers
from ds_megatron.transformer.mlp import ParallelMLP

# DeepSeek-style: dense first and last layer (ffn 24), MoE in between (experts of 8), an ungated shared expert
KW = dict(num_layers=4, ffn_hidden_size=24, moe_ffn_hidden_size=8, moe_layer_freq=[0, 1, 1, 0],
          moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def test_list_form_builds_each_layer_as_listed_and_the_plan_counts_it():
    cfg = moe_config(**KW)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    assert moe_config(num_layers=4, moe_layer_freq=2).moe_layer_pattern == [1, 0, 1, 0]  # the integer form
    model = GPTModel(cfg)
    for i, layer in enumerate(model.layers):
        if i in (1, 2):
            assert isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts.gate_weight is None  # ungated
        else:
            assert isinstance(layer.mlp, ParallelMLP) and layer.mlp.dense_4h_to_h.weight.shape == (16, 24)
    assert gpt_param_counts(cfg, tp=1).total == sum(p.numel() for p in model.parameters())
    # by parameters, the two light dense layers share a stage: [0, 1 (MoE)] would outweigh [2 (MoE), 3]
    heavy = moe_config(**dict(KW, moe_layer_freq=[1, 0, 0, 0], moe_ffn_hidden_size=64))
    layout = ParallelConfig(pipeline_model_parallel_size=2).layout(2)
    assert pipeline_stage_layers(heavy, layout, "parameters") == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("freq,match", [
    ([0, 1, 1], r"list of 4 \(num_layers\) 0s and 1s"), ([0, 1, 2, 0], r"list of 4 \(num_layers\) 0s and 1s"),
    ([0, True, 1, 0], "0s and 1s"), ([0, 0, 0, 0], "no 1, so no layer is MoE"), (0, "positive integer")])
def test_list_form_refusals_are_one_line(freq, match):
    with pytest.raises(ConfigError, match=match) as e:
        moe_config(**dict(KW, moe_layer_freq=freq))
    assert "model.moe_layer_freq" in str(e.value) and "\n" not in str(e.value)


def test_list_form_parses_from_json():
    section = {**MOE, "num_layers": 3, "moe_layer_freq": [0, 1, 1]}
    assert parse_section(GPTConfig, section, "megatron.model").moe_layer_pattern == [0, 1, 1]
    with pytest.raises(ConfigError, match=r"megatron.model.moe_layer_freq must be one of int, List\[int\]"):
        parse_section(GPTConfig, {**section, "moe_layer_freq": "[0, 1, 1]"}, "megatron.model")


def _batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g),
            torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g))


def _sgd_losses(model, state, steps=3, lr=0.5):
    """Float64 SGD steps; a sequence-parallel parameter's gradient is the sum over the TP ranks' sequence parts."""
    from ds_megatron.utils.collectives import all_reduce
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(*_batch(0))  # one batch: the loss must fall
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    continue
                if state is not None and getattr(p, "sequence_parallel", False):
                    all_reduce(p.grad, state.tp)
                p -= lr * p.grad
        losses.append(float(loss))
    return losses


def _train_at(tp, ep):
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=1)
    state = ParallelState.build(layout)
    assert state.dp.size == 1 and state.edp.size == 1  # gradients need no data-parallel reduction
    cfg = moe_config(sequence_parallel=tp > 1, **KW)
    torch.manual_seed(21)
    model = GPTModel(cfg, state).double()
    counted = gpt_param_counts(cfg, tp=tp, ep=ep, etp=1).total
    losses = _sgd_losses(model, state)
    layers_logged = set(model.moe_aux_loss_tracker.per_layer()["load_balancing_loss"])
    state.destroy()
    torch.manual_seed(21)
    ref = GPTModel(moe_config(**KW)).double()
    return losses, _sgd_losses(ref, None), counted, sum(p.numel() for p in model.parameters()), layers_logged


def test_list_form_trains_at_tp2_sp_ep2_like_one_rank():
    for losses, ref, counted, built, layers_logged in run_on_ranks(2, _train_at, 2, 2):
        assert losses == pytest.approx(ref, rel=1e-10) and losses[-1] < losses[0] - 0.1, (losses, ref)
        assert counted == built
        assert layers_logged == {1, 2}  # the routing losses of the MoE layers, by layer number


def _train_job(out, pp, ep):
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    model = dict(MOE, **KW, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
                 gated_linear_unit=True, activation="silu", add_bias_linear=False, seq_length=16, vocab_size=257)
    model["moe_layer_freq"] = [0, 0, 1, 1]  # pipeline stage 0 holds no expert
    divisible = model.pop("make_vocab_size_divisible_by")  # a key of the megatron section itself
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // (4 // pp),
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
           "megatron": {"pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep,
                        "optimizer_impl": "megatron", "make_vocab_size_divisible_by": divisible, "model": model,
                        "train": {"train_iters": 3, "lr": 3e-3, "eval_interval": 100, "eval_iters": 1,
                                  "save_interval": 100, "output_dir": out},
                        "data": {"default_corpus_bytes": 100_000, "split": "90,10"}}}
    job = load_job(cfg, dist.get_world_size())
    return train(job, cfg, show_progress=False).losses


def test_pipeline_stage_without_experts_joins_the_expert_norm(tmp_path):
    # The clipping norm sums expert grads over etp-ep-pp: a stage of dense layers must take part (it hung).
    piped = run_on_ranks(4, _train_job, str(tmp_path / "pp2"), 2, 2)[0]
    flat = run_on_ranks(4, _train_job, str(tmp_path / "pp1"), 1, 2)[0]
    assert sorted(piped) == [1, 2, 3] and all(piped[s] == pytest.approx(flat[s], rel=1e-5) for s in piped)
