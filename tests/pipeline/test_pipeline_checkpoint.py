"""Pipeline checkpoints (our runtime): each stage saves its own chunks; ``--resume`` continues bit-exact.

A 6-step run is compared with the same run stopped after step 4 (saved at
3 and 4) and resumed from the latest checkpoint: the two resumed steps' losses
and the last validation loss must be the same numbers.  Dropout is on, so the
RNG streams of every stage and TP rank must come back too; the distributed
optimizer must restore its shards; MoE experts (folded EP across the
data-parallel ranks) must come back on the stage that holds them.
"""
import os

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

CASES = {
    "tp2-pp2-dropout": dict(tp=2, dropout=0.1),
    "pp2-dp2-distopt-bf16": dict(tp=1, distopt=True, bf16=True),
    "pp2-moe-ep2": dict(tp=1, moe=True),
}


def _config(tmp, tp=1, dropout=0.0, distopt=False, bf16=False, moe=False, save_interval=0, ckpt_format=None):
    model = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
             "hidden_dropout": dropout, "attention_dropout": dropout}
    if moe:
        model.update(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": 2,
            "model": model,
            "train": {"train_iters": 6, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2, "eval_interval": 3,
                      "eval_iters": 2, "save_interval": save_interval, "output_dir": os.path.join(tmp, "run")},
            "data": {"default_corpus_bytes": 1_000_000, "split": "80,20"},
        },
    }
    if moe:
        cfg["megatron"]["expert_model_parallel_size"] = 2
    if distopt:
        cfg["megatron"]["use_distributed_optimizer"] = True
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if ckpt_format:
        cfg["megatron"]["train"]["ckpt_format"] = ckpt_format
    return cfg


def _train(cfg, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size())
    res = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False)
    return res.losses, res.val_losses


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """``unbroken(case)``: the case's uninterrupted run (losses, validation losses), trained once for both formats
    (the checkpoint format does not change the training)."""
    runs = {}

    def run(case):
        if case not in runs:
            out = str(tmp_path_factory.mktemp(f"full-{case}"))
            runs[case] = run_on_ranks(4, _train, _config(out, **CASES[case]))[0]
        return runs[case]
    return run


@pytest.mark.parametrize("ckpt_format", ["deepspeed", "torch_dist"])
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_resume_is_bit_exact(case, ckpt_format, tmp_path, unbroken):
    kwargs = CASES[case]
    full, full_val = unbroken(case)
    cfg = _config(str(tmp_path / "cut"), save_interval=3, ckpt_format=ckpt_format, **kwargs)
    first = run_on_ranks(4, _train, cfg, False, 4)[0][0]
    run_dir = os.path.join(str(tmp_path / "cut"), "run")
    assert open(os.path.join(run_dir, "latest")).read() == "iter_0000004"
    assert os.path.isdir(os.path.join(run_dir, "iter_0000003"))  # the interval's save, then the stop's
    files = os.listdir(os.path.join(run_dir, "iter_0000004"))
    if ckpt_format == "torch_dist":
        assert ".metadata" in files and not any(f.endswith("model_states.pt") for f in files), sorted(files)
    elif kwargs.get("moe"):
        # The experts of all 4 MoE layers go to distinct files whichever stage holds them (whole-model layer ids);
        # the optimizer state to one file per (tp, pp, ep, etp); each stage's dense part to its model-parallel
        # rank's file.
        assert sorted(f for f in files if "_expert_" in f) == sorted(
            f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(4) for e in range(4))
        assert sorted(f for f in files if f.startswith("moe_optim_")) == sorted(
            f"moe_optim_tp_00_pp_{pp:02d}_ep_{ep:03d}_etp_00.pt" for pp in range(2) for ep in range(2))
        assert sorted(f for f in files if f.startswith("mp_rank_")) == ["mp_rank_00_model_states.pt",
                                                                        "mp_rank_01_model_states.pt"]
    else:
        # Our runtime on DeepSpeed's plain engine: one file per model-parallel rank (tp x pp), each holding its
        # stage's chunks (both copies of the tied embedding among them) and its optimizer state.
        assert sorted(f for f in files if f.endswith("model_states.pt")) == [
            f"mp_rank_{r:02d}_model_states.pt" for r in range(2 * kwargs.get("tp", 1))]
    second, second_val = run_on_ranks(4, _train, cfg, True)[0]
    assert sorted(second) == [5, 6]
    for step in range(1, 5):
        assert first[step] == full[step], step
    for step in (5, 6):
        assert second[step] == full[step], step  # bit-exact
    assert second_val[6] == full_val[6]


def _save_then_load_on_the_other_runtime(tmp, saver_chunks):
    import torch
    import ds_megatron
    from ds_megatron.checkpointing.torch_dist import CheckpointFormatError
    from ds_megatron.models import GPTConfig
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "megatron": {"pipeline_model_parallel_size": 2}}
    config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32)

    def engine_of(chunks):
        state = ds_megatron.initialize_model_parallel(cfg)
        torch.manual_seed(0)
        model = ds_megatron.GPTModelChunks(config, state) if chunks else ds_megatron.GPTPipelineModule(config, state)
        return ds_megatron.initialize(model=model, config=cfg, parallel_state=state)[0]

    engine = engine_of(saver_chunks)
    ds_megatron.save_checkpoint(engine, tmp, tag="t")
    engine.megatron.destroy()
    engine = engine_of(not saver_chunks)
    try:
        ds_megatron.load_checkpoint(engine, tmp, tag="t")
        return "loaded"
    except CheckpointFormatError as e:
        return str(e)
    finally:
        engine.megatron.destroy()


@pytest.mark.parametrize("saver_chunks", [True, False], ids=["ours-to-pipeline-engine", "pipeline-engine-to-ours"])
def test_a_deepspeed_format_checkpoint_is_refused_by_the_other_pipeline_runtime(tmp_path, saver_chunks):
    # Each runtime keeps the model in files the other does not read: loading across them is refused, never a
    # model left at its initial weights.
    for message in run_on_ranks(2, _save_then_load_on_the_other_runtime, str(tmp_path), saver_chunks):
        assert "PipelineEngine" in message and "torch_dist" in message and "\n" not in message, message
