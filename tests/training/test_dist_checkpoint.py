"""``ckpt_format: "torch_dist"``: a training checkpoint resumes at another TP / PP / EP / DP.

The reference is the unbroken run at the saving layout (6 steps).  A job saves at step 4 and stops;
the same output directory is resumed at other layouts with the same global batch.  The next two
steps' losses must follow the unbroken run (float tolerance: other layouts sum in another
order).  They would not without the optimizer moments (Adam's first step after a reset is
about lr x sign(grad)), the LR schedule or the data position, all restored from the checkpoint.
"""
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.cli import main as cli_main
from ds_megatron.config import ConfigError, split_config
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel_state import ParallelState
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

GPT = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
       "hidden_dropout": 0.0, "attention_dropout": 0.0}
LLAMA_MOE = {**GPT, "num_query_groups": 2, "position_embedding_type": "rope", "normalization": "RMSNorm",
             "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False,
             "untie_embeddings_and_output_weights": True, "num_experts": 4, "moe_ffn_hidden_size": 16,
             "moe_router_topk": 2, "moe_aux_loss_coeff": 0.0}  # a per-micro-batch loss: layouts differ
STEPS = 6
RESUMED = range(5, STEPS + 1)  # after the checkpoint of step 4


def _config(out, tp=1, pp=1, ep=1, etp=None, mbs=1, world=4, model=GPT, steps=STEPS, distopt=False, precision=None,
            pipeline=None):
    dp = world // (tp * pp)
    megatron = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                "model": model,
                "train": {"train_iters": steps, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2, "eval_interval": 100,
                          "eval_iters": 1, "save_interval": 100, "output_dir": out, "ckpt_format": "torch_dist"},
                "data": {"default_corpus_bytes": 300_000, "split": "90,10"}}
    if etp is not None:
        megatron["expert_tensor_parallel_size"] = etp
    if distopt:
        megatron["use_distributed_optimizer"] = True
    megatron.update(pipeline or {})
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 8 // (mbs * dp),
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 6, "megatron": megatron}
    if precision:
        cfg[precision] = {"enabled": True}
    return cfg


def _train(cfg, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size())
    return train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False).losses


def _resume_at(tmp_path, snapshot, name, **layout):
    """Resume a copy of ``snapshot`` (a run stopped after step 4) at ``layout`` to step ``STEPS``."""
    out = str(tmp_path / name)
    shutil.copytree(snapshot, out)
    return run_on_ranks(4, _train, _config(out, **layout), True)[0]


def _check_follows(resumed, full, rel):
    assert sorted(resumed) == list(RESUMED)
    for step in RESUMED:
        assert resumed[step] == pytest.approx(full[step], rel=rel), step


def _stopped_at_4(tmp_path, **layout):
    """(the unbroken run's losses, a run directory saved at step 4)."""
    full = run_on_ranks(4, _train, _config(str(tmp_path / "full"), **layout))[0]
    snapshot = str(tmp_path / "snapshot")
    first = run_on_ranks(4, _train, _config(snapshot, **layout), False, 4)[0]
    assert [first[s] for s in range(1, 5)] == [full[s] for s in range(1, 5)]
    assert os.path.isfile(os.path.join(snapshot, "iter_0000004", ".metadata"))
    return full, snapshot


def test_tp2_pp2_checkpoint_resumes_at_tp1_dp4_and_tp4(tmp_path):
    saving = dict(tp=2, pp=2, mbs=4)
    full, snapshot = _stopped_at_4(tmp_path, **saving)
    same = _resume_at(tmp_path, snapshot, "same", **saving)
    assert [same[s] for s in RESUMED] == [full[s] for s in RESUMED]  # same layout: bit-exact
    _check_follows(_resume_at(tmp_path, snapshot, "tp1_dp4", tp=1, mbs=1), full, 2e-5)
    _check_follows(_resume_at(tmp_path, snapshot, "tp4", tp=4, mbs=4), full, 2e-5)


def test_interleaved_pipeline_checkpoint_resumes_at_pp4_pp1_and_zero_bubble(tmp_path):
    # Our runtime with 2 chunks per rank (layers 0 | 1 on rank 0 and 2 | 3 on rank 1 become 0, 2 | 1, 3).
    gpt4 = dict(GPT, num_layers=4)
    saving = dict(pp=2, mbs=1, model=gpt4, pipeline={"virtual_pipeline_model_parallel_size": 2})
    full, snapshot = _stopped_at_4(tmp_path, **saving)
    same = _resume_at(tmp_path, snapshot, "same", **saving)
    assert [same[s] for s in RESUMED] == [full[s] for s in RESUMED]  # same layout: bit-exact
    _check_follows(_resume_at(tmp_path, snapshot, "pp4_v1", pp=4, mbs=1, model=gpt4,
                              pipeline={"pipeline_schedule": "interleaved_1f1b"}), full, 2e-5)
    _check_follows(_resume_at(tmp_path, snapshot, "pp1", pp=1, mbs=1, model=gpt4), full, 2e-5)
    _check_follows(_resume_at(tmp_path, snapshot, "zero_bubble", pp=2, mbs=1, model=gpt4,
                              pipeline={"pipeline_schedule": "zero_bubble"}), full, 2e-5)


def test_moe_checkpoint_reshards_across_expert_and_tensor_sizes(tmp_path):
    # Gated experts split over 2 expert-tensor ranks; grouped-query attention (2 groups).  Resumed with
    # the experts spread over 4 ranks whole (distributed optimizer), and at TP=4, where each KV head
    # is replicated on two ranks, without expert parallelism.
    saving = dict(tp=2, ep=2, etp=2, mbs=4, model=LLAMA_MOE)
    full, snapshot = _stopped_at_4(tmp_path, **saving)
    _check_follows(_resume_at(tmp_path, snapshot, "ep4", tp=1, ep=4, etp=1, mbs=1, model=LLAMA_MOE, distopt=True),
                   full, 2e-5)
    _check_follows(_resume_at(tmp_path, snapshot, "tp4", tp=4, ep=1, etp=1, mbs=4, model=LLAMA_MOE), full, 2e-5)


def test_bf16_main_params_and_moments_reshard(tmp_path):
    saving = dict(tp=2, mbs=2, precision="bf16")
    full, snapshot = _stopped_at_4(tmp_path, **saving)
    same = _resume_at(tmp_path, snapshot, "same", **saving)
    assert [same[s] for s in RESUMED] == [full[s] for s in RESUMED]
    _check_follows(_resume_at(tmp_path, snapshot, "tp1", tp=1, mbs=1, precision="bf16", distopt=True), full, 2e-2)


def test_export_fp32_reads_the_whole_model_from_a_torch_dist_checkpoint(tmp_path):
    # The same job (same seed, same steps) saved in both formats: the DeepSpeed-format export puts the
    # rank files together its own way, the torch_dist one reads the stored whole tensors.
    layout = dict(tp=2, pp=2, mbs=4, steps=2)
    dist_run, ds_run = str(tmp_path / "dist"), str(tmp_path / "ds")
    run_on_ranks(4, _train, _config(dist_run, **layout))
    cfg = _config(ds_run, **layout)
    cfg["megatron"]["train"]["ckpt_format"] = "deepspeed"
    run_on_ranks(4, _train, cfg)
    out_dist, out_ds = str(tmp_path / "dist.pt"), str(tmp_path / "ds.pt")
    assert cli_main(["export-fp32", dist_run, out_dist]) == 0
    assert cli_main(["export-fp32", ds_run, out_ds]) == 0
    a, b = torch.load(out_dist), torch.load(out_ds)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    GPTModel(GPTConfig(**GPT), ParallelState.single()).load_state_dict(a, strict=True)


def test_torch_dist_refuses_deepspeeds_optimizer_path():
    cfg = _config("unused")
    cfg["megatron"]["optimizer_impl"] = "deepspeed"
    with pytest.raises(ConfigError, match="ckpt_format"):
        split_config(cfg)


def _own_loop(directory, tp, save):
    """A user's DeepSpeed loop over our GPTModel: 2 steps then save (``save``), or load; then one step's loss."""
    import ds_megatron
    from ds_megatron.optimizer import get_param_groups
    cfg = {"train_micro_batch_size_per_gpu": 4 // (4 // tp), "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
           "megatron": {"tensor_model_parallel_size": tp}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(1 if save else 2)  # the loading side starts from other weights
    model = GPTModel(GPTConfig(**{**GPT, "vocab_size": 64, "make_vocab_size_divisible_by": 8}), state)
    optimizer = torch.optim.AdamW(get_param_groups(model), lr=1e-2)
    engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=optimizer, config=cfg, parallel_state=state)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 33), generator=g) for _ in range(3)]
    dp = state.dp

    def step(batch):
        rows = batch[dp.rank * (4 // dp.size):(dp.rank + 1) * (4 // dp.size)]
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.group)
        return float(total) / dp.size

    if save:
        step(batches[0]), step(batches[1])
        ds_megatron.save_dist_checkpoint(engine, directory, {"note": "two steps"})
    else:
        assert ds_megatron.load_dist_checkpoint(engine, directory) == {"note": "two steps"}
        assert engine.global_steps == 2
    loss = step(batches[2])
    engine.megatron.destroy()
    return loss


def test_a_users_own_loop_saves_at_tp2_dp2_and_resumes_at_tp4(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(4, _own_loop, directory, 2, True)[0]
    resumed = run_on_ranks(4, _own_loop, directory, 4, False)[0]
    assert resumed == pytest.approx(saved, rel=1e-5)
