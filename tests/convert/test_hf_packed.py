"""A packed row of documents through a model imported from Hugging Face gives, for each document, the logits
transformers' own model gives that document alone (float64, 1e-10): Llama, Qwen3, Mixtral, DeepSeek-V3 (MLA),
Mistral with a sliding window, Gemma 2 / 3 and gpt-oss (windows by layer, shorter than the documents; gpt-oss's
attention sinks), both packed forms.

A sliding-window model is imported with ``seq_length`` equal to its window (full causal attention equals the window
on sequences no longer than it, ``config/hf_config.py``), so its packed rows and documents fit in the window and
transformers' sliding-window attention is the reference.
"""
import pytest
import torch

import hf_models
from ds_megatron.convert.checkpoint import HFSource
from ds_megatron.convert.model_io import load_weights
from ds_megatron.models import GPTModel
from ds_megatron.parallel_state import ParallelState

WINDOW = 8
FAMILIES = {
    "llama": lambda: hf_models.make_model("llama"),
    "qwen3": lambda: hf_models.make_model("qwen3"),
    "mixtral": lambda: hf_models.make_model("mixtral"),
    "mistral-sliding-window": lambda: hf_models.make_model("mistral", sliding_window=WINDOW),
    "deepseek_v3": lambda: hf_models.make_deepseek_v3(),
    "gemma2": lambda: hf_models.make_model("gemma2"),  # windows of 4 inside documents longer than them
    "gemma3": lambda: hf_models.make_model("gemma3"),
    "gpt_oss": lambda: hf_models.make_gpt_oss(),  # sinks, windows of 4 inside the documents
}


@pytest.mark.parametrize("form", ["position_ids", "cu_seqlens"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_packed_document_gets_transformers_logits_of_it_alone(tmp_path, family, form):
    hf = FAMILIES[family]()
    hf_dir = hf_models.save(hf, str(tmp_path / "hf"))
    seq = WINDOW if family.endswith("sliding-window") else hf_models.SEQ
    # DeepSeek-V3's router is mapped to fp32 (as transformers computes it); the float64 reference routes in float64.
    f64 = {"moe_router_dtype": None} if family == "deepseek_v3" else {}
    config = HFSource(hf_dir).gpt_config(seq_length=seq, **f64)
    model = GPTModel(config, ParallelState.single()).double().eval()
    load_weights(model, hf_dir, ParallelState.single(), [list(range(config.num_layers))])
    lengths = [[3, 5], [1, 6, 1]] if seq == WINDOW else [[5, 7], [2, 9, 1]]
    if form == "cu_seqlens":  # micro-batch 1, a padding tail
        lengths = [lengths[0][:-1]]
    g = torch.Generator().manual_seed(7)
    docs = [[torch.randint(0, hf_models.VOCAB, (n,), generator=g) for n in row] for row in lengths]
    tokens = torch.full((len(docs), seq), 1)
    positions = torch.zeros_like(tokens)
    for r, row in enumerate(docs):
        at = 0
        for d in row:
            tokens[r, at:at + len(d)] = d
            positions[r, at:at + len(d)] = torch.arange(len(d))
            at += len(d)
        positions[r, at:] = torch.arange(seq - at)
    if form == "cu_seqlens":
        bounds = [0]
        for d in docs[0]:
            bounds.append(bounds[-1] + len(d))
        documents = {"cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}
    else:
        documents = {"position_ids": positions}
    with torch.no_grad():
        ours = model(tokens, **documents)[..., :config.vocab_size]
    reference = hf_models.float64_reference(hf)
    for r, row in enumerate(docs):
        at = 0
        for d in row:
            with torch.no_grad():
                ref = reference(d[None]).logits[0]
            err = hf_models.max_relative_error(ours[r, at:at + len(d)], ref)
            assert err < 1e-10, (family, form, r, at, err)
            at += len(d)
