"""Write a tiny random DeepSeek-V3 in Hugging Face format, with its own BPE tokenizer, for trying the HF path offline.

    python launch/make_tiny_hf_deepseek_v3.py runs/hf/tiny-deepseek-v3 [--seed 0]

The tokenizer is ``make_tiny_hf_llama.py``'s (a 512-token byte-level BPE trained on
1 MB of the embedded corpus, ``<|endoftext|>`` as eos).  The model is transformers'
``DeepseekV3ForCausalLM`` built from a config with every part of the architecture in
play: multi-latent attention with query compression (q_lora_rank 32, kv_lora_rank 32),
YaRN RoPE (128 positions: factor 4 over 32 original ones, mscale 0.707, mscale_all_dim 1), layer 0
dense and layers 1-3 MoE (8 routed experts in 2 groups, 1 group and 2 experts per token,
routed_scaling_factor 2.5, one shared expert), untied output, no multi-token prediction;
random weights in float32, the routers' ``e_score_correction_bias`` random too (transformers
starts it at zero; a non-zero bias steers the choice of experts), saved with
``save_pretrained``.  No download.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_hf_llama import write_tiny_model  # noqa: E402


def make_model(vocab_size, eos_token_id, seed=0):
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        num_nextn_predict_layers=0, max_position_embeddings=128, tie_word_embeddings=False, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=g))
    return model


def main(argv=None):
    return write_tiny_model(make_model, __doc__, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
