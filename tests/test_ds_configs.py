"""Every shipped config validates and trains three steps through the real job on 4 gloo ranks (8 for 3D): the
losses of steps 2 and 3 show the updates the first two made.

A config that continues a Hugging Face model (``train.load_hf``) gets the tiny
model the commands of docs/huggingface.md make (``launch/make_tiny_hf_llama.py``, or for
``runs/hf/tiny-deepseek-v3`` / ``runs/hf/tiny-gemma3`` ``launch/make_tiny_hf_deepseek_v3.py`` /
``launch/make_tiny_hf_gemma3.py``), written to a
temporary directory that replaces its ``load_hf`` and ``data.tokenizer`` paths; a fine-tuning config
(``runs/hf/tiny-chat`` and a ``data_path``) gets docs/finetuning.md's tiny chat model and its chat data packed
by ``preprocess --sft``.
"""
import copy
import glob
import importlib.util
import json
import math
import os
import sys

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
WORLD = {"gpt_tp2_pp2_dp2.json": 8}  # 3D: tp 2 x pp 2 x dp 2; every other config runs on 4 ranks
# Shipped at GPU sizes, trained here smaller after the shipped file validated at its own: gpt_cuda_graphs.json's 16
# bf16 MoE layers at sequence 256 cost ~40 s a step on a 2-core box without native bf16 GEMMs (130 s for one step in
# a loaded CI run); 2 layers at sequence 64 run every path its config takes (bf16, MoE, the CUDA-graph settings
# falling back on a CPU) at a thirty-second of the cost.
SHRINK = {"gpt_cuda_graphs.json": {"num_layers": 2, "seq_length": 64}}
# The maker of each tiny Hugging Face model a config's load_hf names (by its directory's name).
MAKERS = {"tiny-llama": "make_tiny_hf_llama", "tiny-deepseek-v3": "make_tiny_hf_deepseek_v3",
          "tiny-gemma3": "make_tiny_hf_gemma3", "tiny-chat": "make_tiny_chat_model"}


def _few_steps(path, out_dir, steps=3):
    job = load_job(path, dist.get_world_size(), train_iters=steps, output_dir=out_dir)
    shrink = SHRINK.get(os.path.basename(path)) if isinstance(path, str) else None
    if shrink:
        with open(path) as f:
            cfg = json.load(f)
        cfg["megatron"]["model"].update(shrink)
        path = cfg
        job = load_job(cfg, dist.get_world_size(), train_iters=steps, output_dir=out_dir)
    job.train.eval_iters = 1
    job.data.default_corpus_bytes = 1_000_000
    res = train(job, path, show_progress=False)
    return res.losses


def test_configs_are_shipped():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"gpt_cpu_tp2_dp2.json", "gpt_tp1.json", "gpt_tp4.json", "gpt_tp2_sp.json", "moe_ep2.json",
            "moe_ep4_tp2.json", "gpt_bf16_tp2_dp2.json", "gpt_fp16_tp2_dp2.json", "gpt_distopt_tp2_dp2.json",
            "gpt_cuda_graphs.json", "gpt_tp2_pp2.json", "gpt_tp2_pp2_dp2.json", "llama_continue_tp2_pp2.json",
            "gpt_cp2_tp2.json", "deepseek_v3_tiny_tp2_ep2.json", "gpt_tp2_pp2_interleaved.json"} <= names


def _launch_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TOKENIZER = {}


def _trained_once(train):
    """``make_tiny_hf_llama.train_tokenizer`` (deterministic: a BPE of the embedded corpus, which every maker's
    model takes) trained once per module; each caller gets its own copy (the chat maker adds tokens to it)."""
    def tokenizer():
        if "trained" not in _TOKENIZER:
            _TOKENIZER["trained"] = train()
        return copy.deepcopy(_TOKENIZER["trained"])
    return tokenizer


def _with_tiny_hf_model(path, tmp_path, monkeypatch):
    """``path``'s config as a dict, its Hugging Face paths pointing at a fresh tiny model (no download)."""
    with open(path) as f:
        cfg = json.load(f)
    section = cfg["megatron"]
    name = os.path.basename(section["train"]["load_hf"])
    llama = _launch_module("make_tiny_hf_llama")  # the other makers import its tokenizer from it
    monkeypatch.setattr(llama, "train_tokenizer", _trained_once(llama.train_tokenizer))
    monkeypatch.setitem(sys.modules, "make_tiny_hf_llama", llama)
    maker = llama if MAKERS[name] == "make_tiny_hf_llama" else _launch_module(MAKERS[name])
    hf_dir = str(tmp_path / name)
    data = section["data"].get("data_path")
    if data is None:
        assert maker.main([hf_dir]) == 0
    else:  # a chat dataset beside the chat model, packed as docs/finetuning.md packs it
        from ds_megatron.data.preprocess import preprocess_sft
        chats = str(tmp_path / "chat.jsonl")
        assert maker.main([hf_dir, "--data", chats, "--conversations", "120"]) == 0
        section["data"]["data_path"] = str(tmp_path / "chat")
        preprocess_sft([chats], section["data"]["data_path"], hf_dir, section["model"]["seq_length"])
    assert section["train"]["load_hf"] == section["data"]["tokenizer"]  # the model's own tokenizer
    section["train"]["load_hf"] = section["data"]["tokenizer"] = hf_dir
    return cfg


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_config_trains(path, tmp_path, monkeypatch):
    with open(path) as f:
        if "load_hf" in json.load(f)["megatron"].get("train", {}):
            path = _with_tiny_hf_model(path, tmp_path, monkeypatch)
    name = os.path.basename(path) if isinstance(path, str) else ""
    steps = 3
    losses = run_on_ranks(WORLD.get(name, 4), _few_steps, path, str(tmp_path / "run"), steps)
    for rank_losses in losses:
        assert sorted(rank_losses) == list(range(1, steps + 1))
        assert all(math.isfinite(v) for v in rank_losses.values())
    assert all(rank_losses == losses[0] for rank_losses in losses)
