"""Write a tiny random Gemma 3 (text) in Hugging Face format, with its own BPE tokenizer, to try the HF path offline.

    python launch/make_tiny_hf_gemma3.py runs/hf/tiny-gemma3 [--seed 0]

The tokenizer is ``make_tiny_hf_llama.py``'s (a 512-token byte-level BPE trained on
1 MB of the embedded corpus, ``<|endoftext|>`` as eos).  The model is transformers'
``Gemma3ForCausalLM`` built from a config with its parts in play: 6 layers, five sliding
(a window of 32 tokens) to one global, the global layer's RoPE scaled (linear, factor 2,
base 10^6) and the local ones on base 10^4, head_dim 32 (hidden 64, 4 heads, 2 KV heads),
query_pre_attn_scalar 24, QK norm, four (1 + w) norms a layer, tied embeddings scaled by
sqrt(hidden), GeGLU; random weights in float32 (norms too: transformers starts them at 0),
saved with ``save_pretrained``.  No download.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_hf_llama import write_tiny_model  # noqa: E402


def make_model(vocab_size, eos_token_id, seed=0):
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=32, max_position_embeddings=128,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    model = transformers.Gemma3ForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def main(argv=None):
    return write_tiny_model(make_model, __doc__, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
