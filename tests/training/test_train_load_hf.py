"""``ds-megatron train --load-hf``: a Hugging Face model trains at TP=2 x PP=2 and exports back.

With lr 1e-30 (an update far below float32's resolution of these weights) the
weights must come out exactly as they went in: load each rank's
shards from the Hugging Face directory, run the job (DeepSpeed's pipeline
engine, our optimizer), write our layout at the checkpoint, export it with
``ds-megatron convert``: every tensor equals the original, and transformers loads it.
Gemma 2 (soft-caps, windows) at TP=2 + SP: the job's first losses against transformers' in float64 on the job's
own batches, and its export against our float64 model of the trained checkpoint.
"""
import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import hf_models
from harness import run_on_ranks
from ds_megatron.cli import main as cli_main
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.convert.checkpoint import OurSource
from ds_megatron.data.sampler import build_data_loader
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.training.build import build_datasets
from ds_megatron.training.train import train


def _config(out, hf_dir, lr):
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
            "model": {"seq_length": 16},
            "train": {"train_iters": 2, "lr": lr, "min_lr": 0.0, "lr_warmup_iters": 0, "eval_interval": 2,
                      "eval_iters": 1, "output_dir": out, "load_hf": hf_dir},
            "data": {"default_corpus_bytes": 200_000, "split": "80,20"},
        },
    }


def _train(cfg):
    job = load_job(cfg, dist.get_world_size())
    return train(job, cfg, show_progress=False).losses


def _tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("lr", [1e-30, 1e-2])
def test_train_from_hf_and_export(tmp_path, lr):
    model = hf_models.make_model("llama", dtype=torch.float32, vocab_size=300)
    hf_dir = hf_models.save(model, str(tmp_path / "hf"))
    out = str(tmp_path / "run")
    losses = run_on_ranks(4, _train, _config(out, hf_dir, lr))[0]
    assert sorted(losses) == [1, 2]
    exported = str(tmp_path / "exported")
    assert cli_main(["convert", os.path.join(out, "iter_0000002", "ds_megatron_model"), exported]) == 0
    before, after = _tensors(os.path.join(hf_dir, "model.safetensors")), _tensors(os.path.join(exported, "model.safetensors"))
    assert sorted(before) == sorted(after)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    if lr < 1e-20:
        assert changed == []
    else:
        assert len(changed) == len(before)  # every tensor trained
    # The source's non-weight files (here generation_config.json) come along through the job's export.
    gen = "generation_config.json"
    with open(os.path.join(hf_dir, gen)) as a, open(os.path.join(exported, gen)) as b:
        assert a.read() == b.read()
    import transformers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert all(torch.equal(p.detach(), after[n]) for n, p in reloaded.named_parameters())


def test_architecture_keys_are_refused_with_load_hf(tmp_path):
    hf_dir = hf_models.save(hf_models.make_model("llama", dtype=torch.float32, vocab_size=300), str(tmp_path / "hf"))
    cfg = _config(str(tmp_path / "run"), hf_dir, 1e-3)
    cfg["megatron"]["model"]["hidden_size"] = 64
    with pytest.raises(ConfigError, match="model.hidden_size is set but megatron.train.load_hf"):
        load_job(cfg, 4)
    # How CP exchanges K/V is the job's choice, not the checkpoint's: kept, and the weights load (load_weights
    # compares the architecture only; tests/convert/test_hf_deepseek_v3.py loads at cp_comm_type "a2a").
    cfg["megatron"]["model"] = {"seq_length": 16, "cp_comm_type": "a2a"}
    cfg["megatron"].update(tensor_model_parallel_size=1, context_parallel_size=2)
    assert load_job(cfg, 4).megatron.model.cp_comm_type == "a2a"
    small = hf_models.save(hf_models.make_model("llama", dtype=torch.float32), str(tmp_path / "small"))
    with pytest.raises(ConfigError, match="vocab_size=100 but the byte tokenizer"):
        load_job(_config(str(tmp_path / "run"), small, 1e-3), 4)


def test_glm4_moe_saved_by_transformers_trains_and_exports(tmp_path):
    """GLM-4.5 as transformers saves it (one MTP layer declared, none saved): the job says MTP is off in one line,
    trains at TP=2 + SP x PP=2 (our pipeline runtime) x EP=2, and the export (config.json as it came) loads in transformers
    and generates."""
    import json
    import transformers
    model = hf_models.make_glm4_moe(dtype=torch.float32, vocab_size=300)
    hf_dir = hf_models.save(model, str(tmp_path / "hf"))
    out = str(tmp_path / "run")
    cfg = _config(out, hf_dir, 1e-2)
    cfg["megatron"].update(expert_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True)
    cfg["megatron"]["train"].update(train_iters=1, eval_interval=100)  # one step, no evaluation: cheap
    assert [n for n in load_job(cfg, 4).megatron.notices if "multi-token-prediction" in n] == [
        f"{hf_dir}: config.json declares 1 multi-token-prediction layer(s) (num_nextn_predict_layers) but the files "
        "hold none, as transformers saves them: loading the main model with MTP off, as transformers runs it"]
    cfg["megatron"]["model"]["mtp_num_layers"] = 0  # asked off: no line
    assert not [n for n in load_job(cfg, 4).megatron.notices if "multi-token-prediction" in n]
    losses = run_on_ranks(4, _train, cfg)[0]
    assert sorted(losses) == [1]
    exported = str(tmp_path / "exported")
    assert cli_main(["convert", os.path.join(out, "iter_0000001", "ds_megatron_model"), exported]) == 0
    before = _tensors(os.path.join(hf_dir, "model.safetensors"))
    after = _tensors(os.path.join(exported, "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(not torch.equal(before[n], after[n]) for n in before if not n.endswith("e_score_correction_bias"))
    with open(os.path.join(hf_dir, "config.json")) as a, open(os.path.join(exported, "config.json")) as b:
        assert json.load(a) == json.load(b)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    again = hf_models.save(reloaded, str(tmp_path / "again"))  # transformers fuses the experts; saved one by one
    assert all(torch.equal(t, after[n]) for n, t in _tensors(os.path.join(again, "model.safetensors")).items())
    ids = torch.tensor([[1, 2, 3]])
    assert reloaded.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)


def _train_then_logits(cfg, toks):
    """The job of ``cfg`` at TP=2, then our float64 model at that layout loaded from the last checkpoint's
    ``ds_megatron_model``: (losses, validation losses, its logits of ``toks``)."""
    result = train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False)
    tcfg = cfg["megatron"]["train"]
    ours = os.path.join(tcfg["output_dir"], f"iter_{tcfg['train_iters']:07d}", "ds_megatron_model")
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    try:
        logits = hf_models.layout_logits(OurSource(ours).config, state, ours, [[0, 1]], toks)
    finally:
        state.destroy()
    return result.losses, result.val_losses, logits


def _hf_loss(model, batches):
    """The mean over ``batches`` of each micro-batch's mean token loss (the job's), by ``model`` in float64."""
    values = []
    with torch.no_grad():
        for batch in batches:
            logp = torch.log_softmax(model(batch["tokens"]).logits, dim=-1)
            token = -logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
            mask = batch["loss_mask"].double()
            values.append(float((token * mask).sum() / mask.sum()))
    return sum(values) / len(values)


def test_gemma2_trains_from_hf_and_exports(tmp_path):
    """Gemma 2 from ``--load-hf`` at TP=2 + SP, two steps: the loaded model's first training and validation losses
    are transformers' float64 ones on the same batches (to float32 rounding), the soft-caps and the window of 4 in
    sequences of 16 change those losses far beyond that (so the job computes them), and the exported trained model
    loads in transformers with our float64 logits of the checkpoint to 1e-10 and the job's last validation loss."""
    import transformers
    model = hf_models.make_model("gemma2", dtype=torch.float32, vocab_size=300)
    hf_dir = hf_models.save(model, str(tmp_path / "hf"))
    out = str(tmp_path / "run")
    cfg = _config(out, hf_dir, 1e-2)
    cfg["megatron"].update(pipeline_model_parallel_size=1, sequence_parallel=True)
    toks = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))
    losses, val, ours = run_on_ranks(2, _train_then_logits, cfg, toks)[0]
    assert sorted(losses) == [1, 2] and sorted(val) == [0, 2]
    # The job's batches: one DP rank, micro-batches of 2, step 1 the first 2 of them, validation 1 global batch.
    job = load_job(cfg, 2)
    train_ds, valid_ds = build_datasets(job, 4, 4, write_cache=False)
    first = [b for _, b in zip(range(2), build_data_loader(train_ds, 2, 0, 1, 0, seed=job.train.seed))]
    valid = list(build_data_loader(valid_ds, 2, 0, 1, 0))
    assert len(valid) == 2 and all(b["tokens"].shape == (2, 16) for b in first + valid)

    def reference(path, **changes):
        return hf_models.float64_reference(transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", **changes))
    start = reference(hf_dir)
    bound = 1e-6 * 6  # the job computes in float32: its losses near 6 are 5e-7 from float64 here
    assert abs(losses[1] - _hf_loss(start, first)) < bound
    assert abs(val[0] - _hf_loss(start, valid)) < bound
    for changes in (dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                    dict(sliding_window=16)):
        assert abs(val[0] - _hf_loss(reference(hf_dir, **changes), valid)) > 10 * bound, changes  # 7.8e-4 at least
    exported = str(tmp_path / "exported")
    assert cli_main(["convert", os.path.join(out, "iter_0000002", "ds_megatron_model"), exported]) == 0
    trained = reference(exported)
    assert abs(val[2] - _hf_loss(trained, valid)) < bound
    with torch.no_grad():
        assert hf_models.max_relative_error(ours, trained(toks).logits) < 1e-10
