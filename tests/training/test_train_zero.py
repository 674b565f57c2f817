"""DeepSpeed's ZeRO stages under Megatron's tensor parallelism, through ``ds-megatron train`` on 4 gloo ranks.

``"megatron": {"optimizer_impl": "deepspeed"}`` hands the optimizer to DeepSpeed: ZeRO 1 to 3 at TP 2 x DP 2 must
give stage 0's run (fp32 to rounding, bf16 within a bf16 rounding of it), MoE experts reach ZeRO 1/2 as its MoE
param groups, a ZeRO 3 run resumes bit for bit, ``ds-megatron export-fp32`` puts a ZeRO 3 + TP checkpoint's weights
together, and what DeepSpeed cannot do is refused before anything starts.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.checkpointing.export_fp32 import main as export_fp32
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

STEPS = 6


def _config(out, stage, dtype="fp32", tp=2, moe=False, impl="deepspeed", save_interval=0):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
           "megatron": {"optimizer_impl": impl, "tensor_model_parallel_size": tp,
                        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
                                  "vocab_size": 257, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                        "train": {"train_iters": STEPS, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2,
                                  "eval_interval": 1000, "eval_iters": 1, "save_interval": save_interval,
                                  "output_dir": out},
                        "data": {"default_corpus_bytes": 1_000_000, "split": "80,20"}}}
    if impl == "megatron":
        del cfg["zero_optimization"]
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if moe:  # 4 experts over EP 2, each split over ETP = TP 2 (Megatron's default)
        cfg["megatron"]["expert_model_parallel_size"] = 2
        cfg["megatron"]["model"].update(num_experts=4, moe_router_topk=2)
    return cfg


def _train(cfg, resume=False, stop_after=None):
    """The job's losses and grad norms by step (``metrics.jsonl``, which the norm reaches through the engine)."""
    job = load_job(cfg, dist.get_world_size())
    result = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False)
    with open(os.path.join(job.train.output_dir, "metrics.jsonl")) as f:
        norms = {r["step"]: r["grad_norm"] for r in map(json.loads, f) if "grad_norm" in r}
    return result.losses, norms


def _train_each(configs):
    return [_train(cfg) for cfg in configs]


def _run(configs):
    """Each config trained on 4 ranks, one after the other in the same processes; rank 0's results."""
    return run_on_ranks(4, _train_each, configs)[0]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """fp32 stages 0 to 3 (checkpoints at steps 3 and 6) and bf16 stages 1 to 3, at TP 2 x DP 2."""
    root = tmp_path_factory.mktemp("zero")
    runs = [("fp32", s) for s in range(4)] + [("bf16", s) for s in (1, 2, 3)]
    configs = [_config(str(root / f"{dtype}-{stage}"), stage, dtype, save_interval=3) for dtype, stage in runs]
    return {run: (losses, norms, cfg) for run, (losses, norms), cfg in zip(runs, _run(configs), configs)}


def test_zero_stages_1_to_3_give_stage_0s_losses_and_grad_norms(stages):
    # fp32: the stages differ in the order gradients are summed (all-reduce, reduce-scatter by partitions), about
    # 1e-7 relative per step, which Adam's normalised updates carry on: seen <= 2.4e-8 on the losses over 6 steps
    # (3e-7 on the norms).  A
    # gradient reduced over the wrong ranks, a norm missing a rank's shard or a partition stepped twice moves the
    # loss by >= 1e-5 within these steps (clipping is active: the norms are 1.4 to 2.7, the threshold 1).
    losses, norms, _ = stages[("fp32", 0)]
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1] - 0.4
    for stage in (1, 2, 3):
        got, got_norms, _ = stages[("fp32", stage)]
        for step in losses:
            assert got[step] == pytest.approx(losses[step], rel=1e-6), (stage, step)
            assert got_norms[step] == pytest.approx(norms[step], rel=1e-5), (stage, step)


# bf16 rounds every weight, activation and gradient to 8 significant bits: a unit roundoff of 2^-8 relative.  Two
# runs that keep fp32 master weights and fp32 optimizer state see only that rounding, which Adam does not
# accumulate in the weights (the masters take each update at fp32), so each step's loss stays within one unit
# roundoff of the fp32 run's loss; measured: <= 2.1e-4 relative (stages 1 to 3, DeepSpeed's stage 0 at TP 1).  The
# grad norm sums gradients that went through three roundings (weights, activations, the gradients themselves) and a
# bf16 reduction: within four; measured <= 3.1e-3.
# What this bound catches: DeepSpeed's 16-bit optimizer without ZeRO, as DeepSpeed builds it, is 3.3e-3 off
# at step 2 and 1.1e-2 by step 8 (an Adam step taken at construction: every update 0.74x), and with TP 2 its norm
# is TP rank 0's alone (1.41 where the norm is 1.43).
BF16_BOUND = 2.0 ** -8


def test_zero_bf16_stages_track_the_fp32_run(stages):
    losses, norms, _ = stages[("fp32", 0)]
    for stage in (1, 2, 3):
        got, got_norms, _ = stages[("bf16", stage)]
        for step in losses:
            assert got[step] == pytest.approx(losses[step], rel=BF16_BOUND), (stage, step)
            assert got_norms[step] == pytest.approx(norms[step], rel=BF16_BOUND * 4), (stage, step)


def test_zero3_resume_is_bit_exact(stages, tmp_path):
    full, _, cfg = stages[("fp32", 3)]
    cut = json.loads(json.dumps(cfg))
    cut["megatron"]["train"]["output_dir"] = str(tmp_path / "cut")
    first = run_on_ranks(4, _train, cut, False, 3)[0][0]
    assert open(tmp_path / "cut" / "latest").read() == "iter_0000003"
    second = run_on_ranks(4, _train, cut, True)[0][0]
    assert sorted(second) == list(range(4, STEPS + 1))
    assert {**first, **second} == full  # the same data, weights, fp32 partitions, Adam state and LR step


def test_export_fp32_of_a_zero3_tp_checkpoint_is_the_stage_0_runs_weights(stages, tmp_path):
    exported = {}
    for stage in (0, 3):
        out = str(tmp_path / f"stage{stage}.pt")
        assert export_fp32([stages[("fp32", stage)][2]["megatron"]["train"]["output_dir"], out]) == 0
        exported[stage] = torch.load(out)
    # The ZeRO 3 checkpoint holds no weights in its model files: the export put each TP rank's fp32 weights
    # together from its DP ranks' partitions, then placed the TP shards.  Against stage 0's weights after the same
    # 6 steps: their losses agree to 2.4e-8, their weights to Adam's steps over rounding-level gradient differences,
    # seen <= 1.1e-6; a misplaced shard or partition is off by the weights' own size (~2e-2).
    assert exported[3].keys() == exported[0].keys()
    for name, weight in exported[0].items():
        assert exported[3][name].shape == weight.shape, name
        assert torch.allclose(exported[3][name], weight, rtol=0, atol=2e-5), name


def test_moe_ep2_tp2_under_zero_1_and_2_gives_stage_0s_run(tmp_path):
    """Experts split over EP 2 and ETP 2 reach ZeRO as DeepSpeed's MoE param groups (reduced and partitioned over
    their expert-data-parallel group) and the global norm counts each expert once: the losses of stage 0 and of
    Megatron's optimizer (the true global norm), the grad norms of the latter."""
    runs = [(0, "deepspeed"), (1, "deepspeed"), (2, "deepspeed"), (0, "megatron")]
    results = _run([_config(str(tmp_path / f"{impl}-{stage}"), stage, moe=True, impl=impl) for stage, impl in runs])
    (losses, _), (_, norms) = results[0], results[3]
    assert results[3][0] == pytest.approx(losses, rel=1e-6)
    for (stage, _), (got, got_norms) in zip(runs[1:3], results[1:3]):
        for step in losses:
            assert got[step] == pytest.approx(losses[step], rel=1e-6), (stage, step)
            assert got_norms[step] == pytest.approx(norms[step], rel=1e-5), (stage, step)


def test_bf16_without_zero_tracks_the_fp32_run_at_tp1(tmp_path):
    """DeepSpeed's 16-bit optimizer without ZeRO steps its optimizer once at construction; the engine undoes it,
    so the first update is Adam's first."""
    fp32, bf16 = _run([_config(str(tmp_path / name), 0, name, tp=1) for name in ("fp32", "bf16")])
    for step in fp32[0]:
        assert bf16[0][step] == pytest.approx(fp32[0][step], rel=BF16_BOUND), step


@pytest.mark.parametrize("change,error", [
    ({"zero_optimization": {"stage": 2}, "megatron": {"pipeline_model_parallel_size": 2}},
     "zero_optimization.stage=2 with megatron.pipeline_model_parallel_size=2: DeepSpeed's pipeline engine supports "
     "ZeRO stage 0 or 1 only"),
    ({"zero_optimization": {"stage": 3}, "megatron": {"pipeline_model_parallel_size": 2}},
     "zero_optimization.stage=3 with megatron.pipeline_model_parallel_size=2"),
    ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
     "bf16.enabled with zero_optimization.stage 0 and megatron.tensor_model_parallel_size=2 on "
     "megatron.optimizer_impl \"deepspeed\": DeepSpeed's 16-bit optimizer without ZeRO takes the gradient norm that "
     "gradient_clipping=1 divides by from tensor-parallel rank 0 alone"),
    ({"zero_optimization": {"stage": 3}, "megatron": {"expert_model_parallel_size": 2,
                                                      "model": {"num_experts": 4}}},
     "zero_optimization.stage=3 with MoE experts on megatron.optimizer_impl \"deepspeed\": DeepSpeed's ZeRO "
     "supports MoE at stages 1 and 2 only"),
], ids=["pp2-zero2", "pp2-zero3", "bf16-zero0-tp2", "moe-zero3"])
def test_what_deepspeed_cannot_combine_is_refused_at_start_in_one_line(tmp_path, change, error):
    cfg = _config(str(tmp_path / "run"), 1)
    for key, value in change.items():
        if key == "megatron":
            model = value.pop("model", {})
            cfg["megatron"].update(value)
            cfg["megatron"]["model"].update(model)
        else:
            cfg[key] = value
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        load_job(cfg, 4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "train", "--config", str(path)],
                          capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "4"}, timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("ds-megatron train: error: ") and error in line
    assert not os.path.exists(tmp_path / "run")


def test_expert_param_groups_split_for_zero_follow_the_client_schedulers_lr():
    """A client torch optimizer's groups split for ZeRO (experts after the groups it was built with, marked as
    DeepSpeed's MoE groups), and a torch LR scheduler built before the split still drives every group: the
    experts' group takes its source group's LR, LambdaLR's own value, at each step and after a state load."""
    from ds_megatron.integration.moe import SOURCE_GROUP, zero_expert_param_groups
    from ds_megatron.tensor_parallel.params import expert_group_name, mark_expert_param
    dense, experts = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)
    mark_expert_param(experts.weight, 2, 0)
    model = torch.nn.ModuleDict({"dense": dense, "experts": experts})
    optimizer = torch.optim.AdamW([{"params": [dense.weight, experts.weight], "weight_decay": 0.1},
                                   {"params": [dense.bias], "weight_decay": 0.0}], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer, _, scheduler = zero_expert_param_groups(model, optimizer, None, scheduler)
    groups = optimizer.param_groups
    assert [g["params"] for g in groups] == [[dense.weight], [dense.bias], [experts.weight]]
    assert groups[2]["moe"] and groups[2]["name"] == expert_group_name(2) and groups[2][SOURCE_GROUP] == 0
    assert groups[2]["weight_decay"] == 0.1 and not any("moe" in g for g in groups[:2])
    for step in range(1, 4):
        optimizer.step()
        scheduler.step()
        assert [g["lr"] for g in groups] == [0.5 ** step] * 3, step
    state = scheduler.state_dict()
    assert state["last_epoch"] == 3 and scheduler.get_last_lr() == [0.125, 0.125]  # the scheduler's own
    groups[2]["lr"] = 7.0
    scheduler.load_state_dict(state)
    assert groups[2]["lr"] == 0.125
    # A group of experts alone becomes an MoE group itself: no group left empty (DeepSpeed would drop it and move
    # the indices the scheduler drives).
    only = torch.optim.AdamW([{"params": [experts.weight]}], lr=1.0)
    zero_expert_param_groups(model, only, None, None)
    assert len(only.param_groups) == 1 and only.param_groups[0]["moe"] and SOURCE_GROUP not in only.param_groups[0]


def test_bf16_without_zero_at_tp2_and_no_clipping_says_its_reported_norm_is_off(tmp_path):
    from ds_megatron.config import split_config
    cfg = _config(str(tmp_path), 0, "bf16")
    cfg["gradient_clipping"] = 0.0
    notices = split_config(cfg)[1].notices
    assert any("takes the gradient norm it reports from tensor-parallel rank 0 alone" in n for n in notices)
