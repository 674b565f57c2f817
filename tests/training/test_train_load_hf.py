"""``ds-megatron train --load-hf``: a Hugging Face model trains at TP=2 x PP=2 and exports back.

With lr 1e-30 (an update far below float32's resolution of these weights) the
weights must come out exactly as they went in: load each rank's
shards from the Hugging Face directory, run the job (DeepSpeed's pipeline
engine, our optimizer), write our layout at the checkpoint, export it with
``ds-megatron convert``: every tensor equals the original, and transformers loads it.
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
