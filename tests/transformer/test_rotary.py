"""RoPE tables against transformers' own (``ROPE_INIT_FUNCTIONS`` and the models' rotary modules), bit for bit.

Each Hugging Face ``rope_parameters`` goes through ``model_from_hf`` into a ``GPTConfig``, so the mapping of every
key is checked with the formula.  Real model sizes (Llama 3.1, Qwen3 with YaRN, DeepSeek-style mscale, gpt-oss's
untruncated YaRN) and the tiny ones of the logits tests.
"""
import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ds_megatron.config.hf_config import model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.errors import ConfigError
from ds_megatron.transformer.context_parallel import zigzag_chunk_indices
from ds_megatron.transformer.rotary import RotaryEmbedding, rope_frequencies

# name, rope_parameters, head_dim, max_position_embeddings, partial_rotary_factor
CASES = [
    ("default", {"rope_type": "default", "rope_theta": 1e6}, 128, 40960, 1.0),
    ("llama3.1", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 128, 131072, 1.0),
    ("llama3.2-partial", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 64, 131072, 0.5),
    ("llama3-tiny", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64, "rope_theta": 10000.0}, 8, 256, 1.0),
    ("yarn-qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                    "rope_theta": 1e6}, 128, 131072, 1.0),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}, 64, 163840, 1.0),
    ("yarn-untruncated", {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
     64, 131072, 1.0),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                               "attention_factor": 1.25, "rope_theta": 10000.0}, 32, 16384, 1.0),
    ("yarn-no-factor", {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024,
                        "rope_theta": 10000.0}, 16, 4096, 1.0),
    ("linear", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 64, 8192, 1.0),
    ("linear-old-spelling", {"type": "linear", "factor": 2.0}, 32, 4096, 1.0),
]


def _hf_config(params, head_dim, max_positions, partial):
    params = dict(params)
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    key = "rope_scaling" if "type" in params else "rope_parameters"
    return T.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions, **{key: params})


def _ours(hf):
    _, model = model_from_hf({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return GPTConfig(**{**model, "seq_length": 64})


@pytest.mark.parametrize("name,params,head_dim,max_positions,partial", CASES, ids=[c[0] for c in CASES])
def test_tables_equal_transformers(name, params, head_dim, max_positions, partial):
    hf = _hf_config(params, head_dim, max_positions, partial)
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        ref, ref_factor = T.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    config = _ours(hf)
    assert config.rope_scaling_type == (None if kind == "default" else kind)
    inv_freq, factor = rope_frequencies(config)
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, ref), name
    assert factor == ref_factor, name
    # cos and sin as the model applies them (attention factor included), cast to float64
    ours = RotaryEmbedding.from_config(config)
    hf_module = T.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, 1, 1, head_dim, dtype=torch.float64)
    positions = torch.tensor(sorted({0, 1, 7, 100, 5000 % max_positions, max_positions - 1}))
    cos, sin = hf_module(x, positions[None])
    table_cos, table_sin = ours._table(max_positions, "cpu")
    assert torch.equal(table_cos[positions].double(), cos[0]) and torch.equal(table_sin[positions].double(), sin[0])


def test_scaling_changes_the_table():
    """Each type moves the frequencies or cos / sin (else the tests above would pass with plain RoPE)."""
    for name, params, head_dim, max_positions, partial in CASES[1:]:
        config = _ours(_hf_config(params, head_dim, max_positions, partial))
        plain = GPTConfig(**{**vars(config), "rope_scaling_type": None, "use_rope_scaling": False,
                             **{k: f.default for k, f in GPTConfig.__dataclass_fields__.items()
                                if k in GPTConfig._ROPE_SCALING_FIELDS}})
        (scaled, factor), (unscaled, _) = rope_frequencies(config), rope_frequencies(plain)
        assert factor != 1.0 or not torch.equal(scaled, unscaled), name


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_context_parallel_positions_read_the_same_table(kind):
    """A context-parallel rank passes its zigzag positions: the rotation equals the full one at those positions."""
    config = GPTConfig(position_embedding_type="rope", hidden_size=64, num_attention_heads=4, seq_length=32,
                       rope_scaling_type=kind, rope_scaling_factor=4.0, original_max_position_embeddings=16)
    rotary = RotaryEmbedding.from_config(config)
    x = torch.randn(2, 4, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = rotary(x)
    for rank in range(4):
        positions = zigzag_chunk_indices(32, 4, rank)
        assert torch.equal(rotary(x[:, :, positions], positions), full[:, :, positions])


ROPE = dict(position_embedding_type="rope")


@pytest.mark.parametrize("kwargs,match", [
    (dict(rope_scaling_type="dynamic"), "model.rope_scaling_type='dynamic' is unknown; use one of null, \"llama3\""),
    (dict(rope_scaling_type="yarn", position_embedding_type="learned_absolute"),
     "model.rope_scaling_type='yarn' but model.position_embedding_type='learned_absolute'"),
    (dict(rope_scaling_type="linear", rope_scaling_factor=0.0), "model.rope_scaling_factor must be a number > 0"),
    (dict(rope_scaling_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=4.0),
     "model.rope_high_freq_factor=4.0 must exceed model.rope_low_freq_factor=4.0"),
    (dict(rope_scaling_type="yarn", original_max_position_embeddings=0),
     "model.original_max_position_embeddings must be a positive integer"),
    (dict(rope_scaling_type="yarn", yarn_beta_slow=-1.0), "model.yarn_beta_slow must be a number > 0"),
    (dict(rope_scaling_type="yarn", yarn_attention_factor=0.0), "model.yarn_attention_factor must be a number > 0"),
    (dict(rope_scaling_type="linear", yarn_beta_fast=16.0),
     "model.yarn_beta_fast=16.0 is only read with model.rope_scaling_type in yarn (it is 'linear')"),
    (dict(rope_low_freq_factor=2.0), "model.rope_low_freq_factor=2.0 is only read with model.rope_scaling_type in "
                                     "llama3 (it is None); remove it or set rope_scaling_type"),
    (dict(use_rope_scaling=True, rope_scaling_type="yarn"), "model.use_rope_scaling is true (Llama 3.x's scaling) "
                                                            "but model.rope_scaling_type='yarn'"),
])
def test_bad_rope_scaling_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ConfigError) as e:
        GPTConfig(**{**ROPE, **kwargs})
    assert "\n" not in str(e.value) and match in str(e.value), str(e.value)


def test_megatron_use_rope_scaling_is_llama3_with_megatrons_constants():
    config = GPTConfig(**ROPE, kv_channels=128, rotary_base=500000.0, use_rope_scaling=True)
    assert config.rope_scaling_type == "llama3" and config.use_rope_scaling
    hf = _hf_config(CASES[1][1], 128, 131072, 1.0)  # Llama 3.1: factor 8, 1, 4, 8192
    assert torch.equal(rope_frequencies(config)[0], ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0])
