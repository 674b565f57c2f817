"""The whole path with a real tokenizer: train a BPE, preprocess, train at TP=2, export to HF, load in transformers.

A byte-level BPE (``tokenizers``, 512 tokens) is trained on a slice of the embedded
corpus; ``ds-megatron preprocess`` tokenizes that slice with it; a Llama-shaped
model trained from scratch (``train.export_hf_family: "llama"``) runs a few steps
on 2 ranks; ``ds-megatron convert`` exports the checkpoint.  transformers must
then load both the model and the tokenizer from the export, and the HF model's
float64 logits on a tokenized string must equal our model's (the same
checkpoint, loaded at TP=2), and greedy ``generate`` must pick our argmax.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

import bpe_tokenizer
import hf_models
from harness import run_on_ranks
from ds_megatron.cli import main as cli_main
from ds_megatron.config import ConfigError
from ds_megatron.convert.checkpoint import OurSource
from ds_megatron.convert.model_io import load_weights
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

TEXT = "def main(argv):\n    return parse(argv)\n"
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 128,
         "seq_length": 32, "vocab_size": 512, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "position_embedding_type": "rope", "normalization": "RMSNorm", "gated_linear_unit": True,
         "activation": "silu", "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def _config(out, data, tokenizer, family="llama"):
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": 2, "model": dict(MODEL),
            "train": {"train_iters": 3, "lr": 3e-3, "lr_warmup_iters": 0, "eval_interval": 3, "eval_iters": 1,
                      "output_dir": out, "export_hf_family": family},
            "data": {"data_path": data, "tokenizer": tokenizer, "split": "90,10"},
        },
    }


def _train(cfg):
    return train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False).losses


def _our_logits(path, ids):
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    try:
        config = OurSource(path).config
        model = GPTModel(config, state).double().eval()
        load_weights(model, path, state, [list(range(config.num_layers))])
        with torch.no_grad():
            logits = model(ids)
        parts = [torch.empty_like(logits) for _ in range(state.tp.size)]
        dist.all_gather(parts, logits.contiguous(), group=state.tp.group)
        return torch.cat(parts, dim=-1)[..., :config.vocab_size]
    finally:
        state.destroy()


def _bpe_ids(bpe, text):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(bpe, "tokenizer.json")).encode(text).ids


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(BPE directory, dataset prefix) from a 300 kB slice of the embedded corpus."""
    root = tmp_path_factory.mktemp("path")
    bpe = bpe_tokenizer.train_bpe(str(root / "bpe"), vocab_size=512, max_bytes=300_000)
    src = root / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in bpe_tokenizer.corpus_texts(300_000)))
    prefix = str(root / "corpus")
    assert cli_main(["preprocess", "--input", str(src), "--output-prefix", prefix, "--tokenizer", bpe]) == 0
    return bpe, prefix


def test_bpe_preprocess_train_export_generate(tmp_path, prepared):
    import transformers
    bpe, data = prepared
    out = str(tmp_path / "run")
    losses = run_on_ranks(2, _train, _config(out, data, bpe))[0]
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    ours = os.path.join(out, "iter_0000003", "ds_megatron_model")
    exported = str(tmp_path / "hf")
    assert cli_main(["convert", ours, exported]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0].tolist() == _bpe_ids(bpe, TEXT)
    assert tokenizer.eos_token == bpe_tokenizer.EOS
    model = hf_models.float64_reference(transformers.AutoModelForCausalLM.from_pretrained(exported))
    with torch.no_grad():
        hf_logits = model(ids).logits
    our_logits = run_on_ranks(2, _our_logits, ours, ids)[0]
    assert our_logits.shape == hf_logits.shape == (1, ids.shape[1], 512)
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-9, atol=1e-9)

    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape == (1, ids.shape[1] + 4)
    assert generated[0, ids.shape[1]] == our_logits[0, -1].argmax()
    assert isinstance(tokenizer.decode(generated[0, ids.shape[1]:]), str)


def test_models_a_family_cannot_express_are_refused(tmp_path, prepared):
    bpe, data = prepared
    cfg = _config(str(tmp_path / "run"), data, bpe)
    cfg["megatron"]["model"]["normalization"] = "LayerNorm"
    with pytest.raises(ConfigError, match=r"model.normalization='LayerNorm' cannot be exported as 'llama', whose "
                                          r"models have 'RMSNorm'; change model.normalization or remove "
                                          r"megatron.train.export_hf_family"):
        load_job(cfg, 2)
    with pytest.raises(ConfigError, match=r"megatron.train.export_hf_family='gpt2' is not supported; use one "
                                          r"of: llama"):
        load_job(_config(str(tmp_path / "run"), data, bpe, family="gpt2"), 2)
    cfg = _config(str(tmp_path / "run"), data, bpe)
    cfg["megatron"]["model"]["vocab_size"] = 500
    with pytest.raises(ConfigError, match=r"has 512 token ids but megatron.model.vocab_size=500"):
        load_job(cfg, 2)
