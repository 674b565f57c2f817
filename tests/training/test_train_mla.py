"""Multi-latent attention through ``ds-megatron train``: TP=2 with sequence parallelism and CP=2 (the ring, keys and
the narrower values travelling side by side) trains the one-rank model.

The replicated down-projections and latent norms get only their rank's heads' share of the gradient; the job sums
them over TP once per step (``finalize_model_grads``).  Same losses, validation losses and final weights (the TP=2
checkpoint consolidated through ``global_shards``, which places the up-projections and ``o_proj``) as the one-rank
model trained in float64, within float32 noise (``float64_reference``); an unsummed gradient is far outside.
Without biases (DeepSeek-V3 has none): a bias in front of the latent RMSNorm gets a gradient that nearly cancels
over the tokens, which Adam turns into float32 differences of the summation order beyond the measured noise
(1.2e-7 against a bound of 1.05e-7 once); the float64 test in tests/transformer holds those biases' gradients
at TP=2 + SP to 1e-10.
"""
from test_train_context_parallel import _check_same_run

MLA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "multi_latent_attention": True,
       "q_lora_rank": 16, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "add_bias_linear": False}


def test_tp2_sequence_parallel_cp2_mla_trains_the_one_rank_model(tmp_path):
    _check_same_run(tmp_path, 4, {"tp": 2, "sp": True, "cp": 2}, model=MLA)
