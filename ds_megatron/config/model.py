"""``GPTConfig``: the ``megatron.model`` section of a job (pure Python, checked before launch).

``check_layout`` checks the model against a parallel layout (heads and MLP
widths divisible by TP, experts by EP, ...): the one place these rules live.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Tuple, Union

from ..errors import ConfigError


def pad_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> int:
    """Smallest size >= ``orig_vocab_size`` that is a multiple of ``make_vocab_size_divisible_by * tp``.

    Each TP rank then holds a slice whose size is a multiple of
    ``make_vocab_size_divisible_by`` (128 keeps the logit GEMM efficient);
    GPT-2's 50,257 becomes 51,200 for TP=8, as in the Megatron-LM paper.
    """
    if orig_vocab_size <= 0:
        raise ValueError(f"orig_vocab_size={orig_vocab_size} must be positive")
    if make_vocab_size_divisible_by <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError(f"make_vocab_size_divisible_by={make_vocab_size_divisible_by} and "
                         f"tensor_model_parallel_size={tensor_model_parallel_size} must be positive")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "layernorm")


def check_context_parallel_seq_length(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a sequence the zigzag layout cannot cut: ``2 * cp`` equal chunks (each split over TP with SP)."""
    if cp <= 1:
        return
    divisor = 2 * cp * (tp if sequence_parallel else 1)
    if seq_length % divisor:
        what = (f"2 * context_parallel_size * tensor_model_parallel_size = 2 * {cp} * {tp} = {divisor} "
                "(sequence_parallel is on)" if sequence_parallel else f"2 * context_parallel_size = 2 * {cp} = {divisor}")
        raise ConfigError(f"model.seq_length {seq_length} is not divisible by {what}; "
                          "choose a seq_length that is a multiple of it or change context_parallel_size")


@dataclass
class GPTConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    seq_length: int = 128
    vocab_size: int = 257
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    norm_epsilon: float = 1e-5
    layernorm_epsilon: Optional[float] = None  # Megatron's older name of norm_epsilon; sets it when given
    make_vocab_size_divisible_by: int = 128
    sequence_parallel: bool = False
    label_smoothing: float = 0.0
    # Megatron's activation recomputation: None; "full" (a layer keeps only its input and reruns in backward;
    # recompute_method "uniform" (every layer, recompute_num_layers 1) or "block" (the first recompute_num_layers
    # layers of each pipeline stage or chunk)); "selective" (only recompute_modules: "core_attn" (default),
    # "mlp" (dense MLPs), "moe" (MoE layers, shared experts included), "layernorm").
    recompute_granularity: Optional[str] = None
    recompute_modules: Optional[List[str]] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    # Tiling (Arctic Long Sequence Training's idea; names ours): the MLP and the output layer + cross entropy run
    # over this many sequence tiles, each recomputed in backward, so the [s, ffn] and [s, vocab/tp]
    # intermediates exist one tile at a time.  1: untiled.
    mlp_sequence_tiles: int = 1
    loss_sequence_tiles: int = 1
    # Multi-token prediction (DeepSeek-V3; Megatron's names): mtp_num_layers modules after the main model, depth k
    # predicting the token k + 1 ahead; their mean loss x mtp_loss_scaling_factor is added to the main loss.
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # Architecture (Megatron-LM's argument names); the defaults are GPT-2's.
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the fraction of each head's channels RoPE rotates (the first ones)
    # RoPE scaling, each type's inverse frequencies as transformers computes them (transformer/rotary.py):
    # None | "llama3" (Llama 3.1+) | "yarn" | "linear" (position interpolation).
    rope_scaling_type: Optional[str] = None
    use_rope_scaling: bool = False  # Megatron-LM's switch for Llama 3.x's scaling: rope_scaling_type "llama3"
    rope_scaling_factor: float = 8.0  # every type's factor (Megatron-LM's name and Llama 3.1's value)
    # llama3: Megatron-LM hard-codes 1, 4 and 8192; yarn reads original_max_position_embeddings too
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (megatron-core's GPT names); cos and sin are multiplied by yarn_attention_factor, or when it is null by
    # (0.1 ln(s) yarn_mscale + 1) / (0.1 ln(s) yarn_mscale_all_dim + 1) (s = rope_scaling_factor; 1 if s <= 1)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: Optional[float] = None  # transformers' rope_parameters.attention_factor
    yarn_correction_range_round_to_int: bool = True  # transformers' rope_parameters.truncate
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    gated_linear_unit: bool = False  # fc1 -> [gate; up], act(gate) * up (SwiGLU with activation "silu")
    activation: str = "gelu"  # gelu | silu | gelu_tanh (GELU's tanh approximation; GeGLU of Gemma) | quick_gelu
    # gpt-oss's clamped GLU (Megatron's names): gate.clamp(max=v) and up.clamp(-v, v) before act(gate) * (up + offset)
    activation_func_clamp_value: Optional[float] = None
    glu_linear_offset: float = 0.0
    num_query_groups: Optional[int] = None  # grouped-query attention; None: num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # per-head width; None: hidden_size / num_attention_heads
    add_bias_linear: bool = True  # biases of every linear layer (QKV, attention output, MLP)
    add_qkv_bias: bool = False  # biases of QKV alone (Qwen2); QKV has a bias when either is set
    untie_embeddings_and_output_weights: bool = False  # a separate output layer instead of the word embedding
    qk_layernorm: bool = False  # a norm (of `normalization`) over each head's query and key
    # Gemma 2 / 3 (transformer/attention.py, norm.py, layer.py; Megatron's names where it has them):
    # every norm's weight applied as (1 + w), the product in float32 before the cast back (Megatron's switch)
    layernorm_zero_centered_gamma: bool = False
    post_sublayer_norms: bool = False  # a norm on the attention's and the MLP's outputs before each residual add
    apply_embedding_scaling: bool = False  # word embeddings x sqrt(hidden_size), rounded to their dtype first
    softmax_scale: Optional[float] = None  # the attention scores' scale; None: 1 / sqrt(head_dim)
    # Megatron's softmax_type: "vanilla", or "learnable" (gpt-oss's attention sinks: one learned logit per head in
    # the softmax's denominator, taking probability from the keys and adding nothing to the output)
    softmax_type: str = "vanilla"
    attn_logit_softcapping: Optional[float] = None  # scores -> cap * tanh(scores / cap) before the mask and softmax
    final_logit_softcapping: Optional[float] = None  # the logits -> cap * tanh(logits / cap)
    # Sliding-window attention (Megatron's names): window_size [left, right], query i sees key j iff
    # i - left <= j <= i + right (right 0: causal; Hugging Face's sliding_window w is left = w - 1), in the layers
    # window_attn_skip_freq picks: an int N, every layer but each N-th (1-based) one; a list, 1 per windowed layer.
    # None: every layer windowed.
    window_size: Optional[List[int]] = None
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    local_rotary_base: Optional[float] = None  # RoPE base of the windowed layers, unscaled (Gemma 3's local base)
    # Multi-latent attention (DeepSeek-V2/V3; megatron-core's names; transformer/multi_latent_attention.py): q from
    # h -> q_lora_rank -> norm -> heads x (qk_head_dim + qk_pos_emb_head_dim) (null q_lora_rank: one projection), k and
    # v from h -> kv_lora_rank -> norm -> heads x (qk_head_dim + v_head_dim), plus a qk_pos_emb_head_dim RoPE key
    # shared by the heads.  The defaults are megatron-core's.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # the per-head q/k channels without position (DeepSeek's qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 64  # the per-head q/k channels RoPE turns (DeepSeek's qk_rope_head_dim)
    v_head_dim: int = 128
    # Context parallelism's exchange (Megatron's TransformerConfig.cp_comm_type): "p2p" (ring), "all_gather" or "a2a"
    cp_comm_type: str = "p2p"
    # MoE (ds_megatron/moe; Megatron-LM's argument names)
    num_experts: Optional[int] = None  # None: a dense model
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    # int k: every k-th layer (0, k, 2k, ...) is an MoE layer; or Megatron's list form, one 0 (dense MLP of
    # ffn_hidden_size) or 1 (MoE) per layer, e.g. [0, 0, 0] + [1] * 58 for DeepSeek-V3's dense first layers
    moe_layer_freq: Union[int, List[int]] = 1
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax before top-k instead of over the chosen k
    # DeepSeek-V3 routing (Megatron-core's names; ds_megatron/moe/router.py)
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (sigmoid scores only)
    moe_router_bias_update_rate: float = 1e-3  # the expert bias's step per optimizer step
    moe_router_num_groups: Optional[int] = None  # group-limited top-k: experts in this many groups ...
    moe_router_group_topk: Optional[int] = None  # ... of which this many are kept per token
    moe_router_topk_scaling_factor: Optional[float] = None  # the chosen weights x this
    moe_router_dtype: Optional[str] = None  # null (the activations') | fp32 | fp64: the router's logits and scores
    # biases of the MoE layers' router and experts' fc1 and fc2 (gpt-oss; Megatron ties them to add_bias_linear,
    # which here leaves the experts bias-free as before)
    moe_add_bias_linear: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: Optional[float] = None  # None: no token dropping
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    moe_shared_expert_intermediate_size: Optional[int] = None  # a dense shared expert of this width (Qwen2-MoE)
    moe_shared_expert_ffn_hidden_size: Optional[int] = None  # the earlier name of the field above; sets it
    moe_shared_expert_gate: bool = False  # shared expert output x sigmoid(x . w) (Qwen2-MoE)
    # GroupedMLP / SequentialMLP; None: the faster for the device (grouped with CUDA, sequential on CPU:
    # launch/bench/bench_moe.py)
    moe_grouped_gemm: Optional[bool] = None
    # FP8 GEMMs of the transformer's linear layers (Megatron's names; ds_megatron/fp8): fp8 null | "e4m3" |
    # "hybrid" (E4M3 forward, E5M2 gradients); fp8_recipe "tensorwise" (current scaling), "delayed" (amax
    # history) or "blockwise" (DeepSeek-V3's 1x128 / 128x128 power-of-two scales).
    fp8: Optional[str] = None
    fp8_recipe: str = "tensorwise"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    first_last_layers_bf16: bool = False  # keep the first / last layers' GEMMs in 16-bit
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self._resolve_aliases()
        self._check_fp8()
        self._check_moe()
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads and not self.multi_latent_attention:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_attention_heads={self.num_attention_heads}; pick sizes that divide, or set "
                              "model.kv_channels")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ConfigError(f"model.cp_comm_type={self.cp_comm_type!r} is not one of {CP_COMM_TYPES}")
        self._check_recompute()
        self._check_tiles()
        self._check_mtp()
        self._check_mla()
        self._check_architecture()
        self._check_rope_scaling()
        self._check_windows()

    def _check_recompute(self) -> None:
        granularity = self.recompute_granularity
        if granularity not in (None, "full", "selective"):
            raise ConfigError(f"model.recompute_granularity={granularity!r} is not supported; use \"full\", "
                              "\"selective\" or null")
        if self.recompute_modules is not None and granularity != "selective":
            raise ConfigError("model.recompute_modules is set but model.recompute_granularity is not \"selective\"; "
                              "set it, or drop recompute_modules")
        if granularity == "selective":
            if self.recompute_modules is None:
                self.recompute_modules = ["core_attn"]  # Megatron's default
            modules = self.recompute_modules
            if not isinstance(modules, list) or not modules:
                raise ConfigError(f"model.recompute_modules={modules!r} must be a non-empty list of "
                                  f"{', '.join(RECOMPUTE_MODULES)}")
            for m in modules:
                if m in ("moe_act", "mla_up_proj"):
                    raise ConfigError(f"model.recompute_modules entry {m!r} is not supported yet (the experts' "
                                      "activation alone is not recomputed, nor multi-latent attention's "
                                      "up-projections alone); use \"moe\" (the whole MoE layer), core_attn, mlp, "
                                      "layernorm")
                if m not in RECOMPUTE_MODULES:
                    raise ConfigError(f"model.recompute_modules entry {m!r} is unknown; use "
                                      f"{', '.join(RECOMPUTE_MODULES)}")
        if (self.recompute_method is not None or self.recompute_num_layers is not None) and granularity != "full":
            raise ConfigError("model.recompute_method / recompute_num_layers need model.recompute_granularity "
                              "\"full\"; set it, or drop them")
        if granularity == "full":
            method = self.recompute_method or "uniform"
            if method not in ("uniform", "block"):
                raise ConfigError(f"model.recompute_method={method!r} is unknown; use \"uniform\" or \"block\"")
            n = self.recompute_num_layers
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ConfigError(f"model.recompute_num_layers must be an integer >= 0, got {n!r}")
            if method == "uniform" and n not in (None, 1):
                # Megatron checkpoints groups of n layers as one; ours recomputes layer by layer.
                raise ConfigError(f"model.recompute_num_layers={n} with recompute_method \"uniform\": groups of "
                                  "layers recomputed as one are not implemented; use 1 (every layer on its own) or "
                                  "recompute_method \"block\"")
            if method == "block" and n is None:
                raise ConfigError("model.recompute_method \"block\" needs model.recompute_num_layers (the layers "
                                  "of each pipeline stage or chunk recomputed, from its first)")

    def _check_mtp(self) -> None:
        n = self.mtp_num_layers
        if n is None or n == 0:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"model.mtp_num_layers must be a non-negative integer (null or 0: off), got {n!r}")
        if not self.mtp_loss_scaling_factor > 0:
            raise ConfigError(f"model.mtp_loss_scaling_factor must be > 0, got {self.mtp_loss_scaling_factor!r}")

    def _check_tiles(self) -> None:
        for name in ("mlp_sequence_tiles", "loss_sequence_tiles"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer (1: untiled), got {v!r}")
        if self.mlp_sequence_tiles > 1 and self.num_experts:
            # The routing losses and capacity of a tile are not the whole sequence's.
            raise ConfigError("model.mlp_sequence_tiles > 1 with model.num_experts: MoE layers route the whole "
                              "sequence at once; set mlp_sequence_tiles to 1")

    def _check_fp8(self) -> None:
        if self.fp8 is None:
            return
        for name, allowed in (("fp8", ("e4m3", "hybrid")), ("fp8_recipe", ("tensorwise", "delayed", "blockwise")),
                              ("fp8_amax_compute_algo", ("most_recent", "max"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown; use one of "
                                  f"{', '.join(map(repr, allowed))}")
        for name, low in (("fp8_margin", 0), ("fp8_amax_history_len", 1), ("num_layers_at_start_in_bf16", 0),
                          ("num_layers_at_end_in_bf16", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"model.{name} must be an integer >= {low}, got {v!r}")
        if self.fp8_recipe == "blockwise":
            # MLA's latents feed the up-projections' forward GEMMs (kv_lora_rank + qk_pos_emb_head_dim, an output
            # width, may leave a partial tile)
            latents = ("q_lora_rank", "kv_lora_rank") if self.multi_latent_attention else ()
            for name in ("hidden_size", "seq_length") + latents:
                if (getattr(self, name) or 0) % 128:  # a null q_lora_rank: no query latent
                    raise ConfigError(f"model.{name}={getattr(self, name)} is not a multiple of 128, which "
                                      "fp8_recipe \"blockwise\" tiles by; choose a multiple of 128 or fp8_recipe "
                                      "\"tensorwise\"")

    def fp8_layer(self, layer_number: int) -> bool:
        """Whether transformer layer ``layer_number`` (0-based, of the whole model) runs its GEMMs in fp8."""
        if self.fp8 is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 <= layer_number < self.num_layers - self.num_layers_at_end_in_bf16

    def recomputes_layer(self, local_index: int) -> bool:
        """Whether the layer at ``local_index`` in its owner (the model, a pipeline stage or chunk) is recomputed
        whole (``recompute_granularity`` "full", by ``recompute_method``)."""
        if self.recompute_granularity != "full":
            return False
        return self.recompute_method != "block" or local_index < self.recompute_num_layers

    def _resolve_aliases(self) -> None:
        for old, new, default in (("layernorm_epsilon", "norm_epsilon", 1e-5),
                                  ("moe_shared_expert_ffn_hidden_size", "moe_shared_expert_intermediate_size", None)):
            value = getattr(self, old)
            if value is None:
                continue
            if getattr(self, new) not in (default, value):
                raise ConfigError(f"model.{old}={value!r} and model.{new}={getattr(self, new)!r} disagree; {old} is "
                                  f"the older name of {new}: set only {new}")
            setattr(self, new, value)
        self.layernorm_epsilon = self.norm_epsilon  # both names read the same value afterwards
        self.moe_shared_expert_ffn_hidden_size = self.moe_shared_expert_intermediate_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head (``kv_channels``, or hidden_size / num_attention_heads)."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def head_widths(self) -> Tuple[int, int]:
        """One head's (query/key, value) channels: multi-latent attention's ``qk_head_dim + qk_pos_emb_head_dim``
        and ``v_head_dim``, else ``head_dim`` both."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        """How many channels of each head RoPE rotates (multi-latent attention: the positional part)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    _MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    # Standard-attention fields multi-latent attention has no counterpart for: only these values are accepted.
    _MLA_REFUSED = {"kv_channels": (None,), "qk_layernorm": (False,), "add_qkv_bias": (False,), "rotary_percent": (1.0,)}

    def _check_mla(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        if not self.multi_latent_attention:
            for name in self._MLA_FIELDS:
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"model.{name}={getattr(self, name)!r} is only read with "
                                      "model.multi_latent_attention true; remove it or turn multi-latent attention on")
            return
        for name in self._MLA_FIELDS:
            v = getattr(self, name)
            if not (name == "q_lora_rank" and v is None) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"model.{name} must be a positive integer{' or null' * (name == 'q_lora_rank')} with "
                                  f"model.multi_latent_attention, got {v!r}")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"model.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} is odd; RoPE rotates pairs of "
                              "channels: choose an even number")
        if self.position_embedding_type != "rope":
            raise ConfigError(f"model.position_embedding_type={self.position_embedding_type!r} with "
                              "model.multi_latent_attention: its positions are the RoPE part of q and k; set \"rope\"")
        if self.num_query_groups not in (None, self.num_attention_heads):
            raise ConfigError(f"model.num_query_groups={self.num_query_groups} with model.multi_latent_attention: every "
                              "head has its own k and v from the latent; set it to null")
        for name, allowed in self._MLA_REFUSED.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is not supported with "
                                  f"model.multi_latent_attention; set it to {allowed[0]!r}".replace("None", "null"))

    def _check_architecture(self) -> None:
        choices = {"position_embedding_type": ("learned_absolute", "rope", "none"),
                   "normalization": ("LayerNorm", "RMSNorm"),
                   "activation": ("gelu", "silu", "gelu_tanh", "quick_gelu"), "softmax_type": ("vanilla", "learnable")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown; use one of {', '.join(allowed)}")
        for name in ("num_query_groups", "kv_channels"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"model.{name} must be a positive integer or null, got {v!r}")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"model.num_query_groups={self.query_groups}; every query group needs the same number "
                              "of heads: pick a divisor of num_attention_heads")
        if self.norm_epsilon <= 0:
            raise ConfigError(f"model.norm_epsilon must be > 0, got {self.norm_epsilon!r}")
        v = self.activation_func_clamp_value
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ConfigError(f"model.activation_func_clamp_value must be a number > 0 or null, got {v!r}")
        if (v is not None or self.glu_linear_offset) and not self.gated_linear_unit:
            raise ConfigError("model.activation_func_clamp_value / glu_linear_offset shape a gated linear unit; set "
                              "gated_linear_unit true or remove them")
        if self.softmax_type == "learnable" and (self.multi_latent_attention or self.attn_logit_softcapping):
            raise ConfigError("model.softmax_type \"learnable\" is built for the plain attention core; set it to "
                              "\"vanilla\" with multi_latent_attention or attn_logit_softcapping")
        if self.layernorm_zero_centered_gamma and self.normalization != "RMSNorm":
            raise ConfigError("model.layernorm_zero_centered_gamma is built for RMSNorm only (Gemma's); set "
                              "normalization \"RMSNorm\" or turn it off")
        if self.position_embedding_type == "rope":
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ConfigError(f"model.rotary_percent={self.rotary_percent!r} is outside (0, 1]; it is the "
                                  "fraction of each head RoPE rotates: use a value in (0, 1]")
            if self.rotary_base <= 0:
                raise ConfigError(f"model.rotary_base must be > 0, got {self.rotary_base!r}")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ConfigError(f"model.rotary_percent={self.rotary_percent} of head_dim={self.head_dim} rotates "
                                  f"{self.rotary_dim} channels; RoPE rotates pairs: choose sizes that make "
                                  "head_dim * rotary_percent an even number >= 2")

    def _check_windows(self) -> None:
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping", "local_rotary_base"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ConfigError(f"model.{name} must be a number > 0 or null, got {v!r}")
        if self.multi_latent_attention:
            for name in ("softmax_scale", "attn_logit_softcapping"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"model.{name}={getattr(self, name)!r} with model.multi_latent_attention: its "
                                      "core scales by its own head widths and has no soft-cap; set it to null")
        if self.local_rotary_base is not None and self.position_embedding_type != "rope":
            raise ConfigError(f"model.local_rotary_base={self.local_rotary_base!r} but model.position_embedding_type="
                              f"{self.position_embedding_type!r}; it is RoPE's base: set \"rope\" or remove it")
        window, skip = self.window_size, self.window_attn_skip_freq
        if isinstance(window, tuple):
            self.window_size = window = list(window)
        if window is None:
            if skip is not None or self.local_rotary_base is not None:
                name = "window_attn_skip_freq" if skip is not None else "local_rotary_base"
                raise ConfigError(f"model.{name} is set but model.window_size is null; it is only read with "
                                  "sliding-window attention: set window_size or remove it")
            return
        if (not isinstance(window, list) or len(window) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in window) or window[0] < 0):
            raise ConfigError(f"model.window_size={window!r} must be [left, right] with left an integer >= 0")
        if window[1] != 0:
            raise ConfigError(f"model.window_size={window!r}: keys after the query (right={window[1]}) break causal "
                              "language modelling; set right to 0")
        if isinstance(skip, tuple):
            self.window_attn_skip_freq = skip = list(skip)
        if isinstance(skip, list):
            if len(skip) != self.num_layers or any(isinstance(v, bool) or v not in (0, 1) for v in skip):
                raise ConfigError(f"model.window_attn_skip_freq={skip!r} must be a list of {self.num_layers} "
                                  "(num_layers) 0s and 1s, 1 where the layer is windowed; fix its length or values")
        elif skip is not None and (isinstance(skip, bool) or not isinstance(skip, int) or skip < 1):
            raise ConfigError(f"model.window_attn_skip_freq={skip!r} must be a positive integer, a 0/1 list or null")
        if self.multi_latent_attention:
            raise ConfigError("model.window_size with model.multi_latent_attention is not built; set window_size "
                              "to null")

    def attention_window(self, layer_index: int) -> Optional[int]:
        """How many earlier keys (``window_size[0]``) the queries of layer ``layer_index`` (0-based, of the whole
        model) see besides their own, or None for full causal attention (Megatron's is_layer_window_attention).
        Multi-token-prediction layers are of the decoder's last layer's kind."""
        if self.window_size is None:
            return None
        i = min(layer_index, self.num_layers - 1)
        skip = self.window_attn_skip_freq
        windowed = (skip is None or (bool(skip[i]) if isinstance(skip, list) else (i + 1) % skip != 0))
        return self.window_size[0] if windowed else None

    # RoPE scaling: which fields each type reads (a field set for a type that ignores it is refused).
    _ROPE_SCALING_FIELDS = {
        "rope_scaling_factor": ("llama3", "yarn", "linear"),
        "rope_low_freq_factor": ("llama3",), "rope_high_freq_factor": ("llama3",),
        "original_max_position_embeddings": ("llama3", "yarn"),
        "yarn_beta_fast": ("yarn",), "yarn_beta_slow": ("yarn",), "yarn_mscale": ("yarn",),
        "yarn_mscale_all_dim": ("yarn",), "yarn_attention_factor": ("yarn",),
        "yarn_correction_range_round_to_int": ("yarn",),
    }

    def _check_rope_scaling(self) -> None:
        types = (None, "llama3", "yarn", "linear")
        if self.rope_scaling_type not in types:
            raise ConfigError(f"model.rope_scaling_type={self.rope_scaling_type!r} is unknown; use one of null, "
                              "\"llama3\", \"yarn\", \"linear\"")
        if self.use_rope_scaling:
            if self.rope_scaling_type not in (None, "llama3"):
                raise ConfigError(f"model.use_rope_scaling is true (Llama 3.x's scaling) but model.rope_scaling_type="
                                  f"{self.rope_scaling_type!r}; set only rope_scaling_type")
            self.rope_scaling_type = "llama3"
        self.use_rope_scaling = self.rope_scaling_type == "llama3"  # both names read the same afterwards
        kind = self.rope_scaling_type
        if kind is not None and self.position_embedding_type != "rope":
            raise ConfigError(f"model.rope_scaling_type={kind!r} but model.position_embedding_type="
                              f"{self.position_embedding_type!r}; RoPE scaling needs position_embedding_type \"rope\"")
        defaults = {f.name: f.default for f in fields(self)}
        for name, readers in self._ROPE_SCALING_FIELDS.items():
            if kind not in readers and getattr(self, name) != defaults[name]:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is only read with model.rope_scaling_type in "
                                  f"{', '.join(readers)} (it is {kind!r}); remove it or set rope_scaling_type")
        if kind is None:
            return
        positive = ["rope_scaling_factor"]
        positive += {"llama3": ["rope_low_freq_factor", "rope_high_freq_factor"],
                     "yarn": ["yarn_beta_fast", "yarn_beta_slow"]}.get(kind, [])
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"model.{name} must be a number > 0 with rope_scaling_type {kind!r}, got {v!r}")
        if kind in ("llama3", "yarn"):
            v = self.original_max_position_embeddings
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.original_max_position_embeddings must be a positive integer (the "
                                  f"pretraining context of rope_scaling_type {kind!r}), got {v!r}")
        if kind == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor}: llama3 scaling blends the "
                              "frequencies between the two; raise rope_high_freq_factor")
        if kind == "yarn":
            for name in ("yarn_mscale", "yarn_mscale_all_dim"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"model.{name} must be a number, got {v!r}")
            v = self.yarn_attention_factor
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ConfigError(f"model.yarn_attention_factor must be a number > 0 or null (derived from "
                                  f"yarn_mscale / yarn_mscale_all_dim), got {v!r}")

    # MoE
    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self._check_moe_layer_pattern()
        for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk") + (
                () if isinstance(self.moe_layer_freq, list) else ("moe_layer_freq",)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(f"model.moe_router_topk={self.moe_router_topk} is larger than model.num_experts="
                              f"{self.num_experts}; a token cannot go to more experts than exist: lower topk")
        choices = {"moe_router_score_function": ("softmax", "sigmoid"), "moe_token_drop_policy": ("probs", "position"),
                   "moe_token_dispatcher_type": ("alltoall", "allgather")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown; use one of {', '.join(allowed)}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"model.moe_capacity_factor must be > 0 (or null for no dropping), "
                              f"got {self.moe_capacity_factor!r}")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ConfigError("model.moe_shared_expert_gate is true but model.moe_shared_expert_intermediate_size is "
                              "not set; the gate scales the shared expert: set its size or turn the gate off")
        if self.moe_pad_expert_input_to_capacity and self.moe_capacity_factor is None:
            raise ConfigError("model.moe_pad_expert_input_to_capacity is true but model.moe_capacity_factor is null; "
                              "padding fills experts to their capacity: set a capacity factor or turn padding off")
        self._check_moe_router()

    def _check_moe_router(self) -> None:
        choices = {"moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
                   "moe_router_dtype": (None, "fp32", "fp64")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown; use one of "
                                  f"{', '.join('null' if a is None else a for a in allowed)}")
        if self.moe_router_load_balancing_type == "none" and self.moe_aux_loss_coeff:
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} with "
                              "model.moe_router_load_balancing_type \"none\" (no balancing loss); set the coeff to 0 "
                              "or choose a loss type")
        if self.moe_router_enable_expert_bias:
            if self.moe_router_score_function != "sigmoid":
                raise ConfigError("model.moe_router_enable_expert_bias needs model.moe_router_score_function "
                                  f"\"sigmoid\" (it is {self.moe_router_score_function!r}, which Megatron refuses too)")
            v = self.moe_router_bias_update_rate
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"model.moe_router_bias_update_rate must be a number > 0, got {v!r}")
        v = self.moe_router_topk_scaling_factor
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ConfigError(f"model.moe_router_topk_scaling_factor must be a number > 0 or null, got {v!r}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ConfigError("model.moe_router_num_groups and model.moe_router_group_topk go together (group-limited "
                              "top-k): set both or neither")
        if groups is None:
            return
        for name in ("moe_router_num_groups", "moe_router_group_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer or null, got {v!r}")
        if self.num_experts % groups:
            raise ConfigError(f"model.num_experts={self.num_experts} is not divisible by model.moe_router_num_groups="
                              f"{groups}; the groups are equal: choose a divisor")
        if group_topk > groups:
            raise ConfigError(f"model.moe_router_group_topk={group_topk} is larger than model.moe_router_num_groups="
                              f"{groups}; lower it")
        k, per_group = self.moe_router_topk, self.num_experts // groups
        if not group_topk <= k <= group_topk * per_group:
            # a group scores its best topk // group_topk experts (0 would be none), and the kept groups need k experts
            raise ConfigError(f"model.moe_router_topk={k} must be in [moe_router_group_topk, moe_router_group_topk x "
                              f"experts per group] = [{group_topk}, {group_topk * per_group}]; change topk or the groups")

    def _check_moe_layer_pattern(self) -> None:
        if isinstance(self.moe_layer_freq, tuple):
            self.moe_layer_freq = list(self.moe_layer_freq)
        freq = self.moe_layer_freq
        if not isinstance(freq, list):
            return
        if len(freq) != self.num_layers or any(isinstance(v, bool) or v not in (0, 1) for v in freq):
            raise ConfigError(f"model.moe_layer_freq={freq!r} must be an integer or a list of {self.num_layers} "
                              "(num_layers) 0s and 1s, 1 where the layer is MoE; fix its length or values")
        if not any(freq):
            raise ConfigError("model.moe_layer_freq has no 1, so no layer is MoE; mark the MoE layers with 1, or "
                              "unset model.num_experts for a dense model")

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` (0-based) uses an MoE MLP (Megatron's moe_layer_freq: every k-th layer
        for an integer k, else the layer's entry of the 0/1 list); the others use a dense MLP of ffn_hidden_size.
        The multi-token-prediction layers (``num_layers + k``) are of the decoder's last layer's kind, as
        megatron-core builds them from its last layer's spec."""
        if self.num_experts is None:
            return False
        if self.num_layers <= layer_index < self.num_layers + (self.mtp_num_layers or 0):
            layer_index = self.num_layers - 1
        if isinstance(self.moe_layer_freq, list):
            if not 0 <= layer_index < len(self.moe_layer_freq):
                raise IndexError(f"layer {layer_index} is not one of the {len(self.moe_layer_freq)} layers of "
                                 "model.moe_layer_freq")
            return bool(self.moe_layer_freq[layer_index])
        return layer_index % self.moe_layer_freq == 0

    @property
    def moe_layer_pattern(self) -> List[int]:
        """One 0 (dense) or 1 (MoE) per decoder layer: Megatron's list form of ``moe_layer_freq``."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    def check_expert_parallel(self, ep: int, etp: int) -> None:
        """The expert sizes of the layout fit this model (ConfigError naming the fields otherwise)."""
        if self.num_experts is None:
            if ep > 1:
                raise ConfigError(f"megatron.expert_model_parallel_size={ep} but model.num_experts is not set; "
                                  "set num_experts or use expert_model_parallel_size 1")
            return
        if self.num_experts % ep:
            raise ConfigError(f"model.num_experts={self.num_experts} is not divisible by "
                              f"megatron.expert_model_parallel_size={ep}; each EP rank must hold the same number "
                              "of experts: change one of them")
        if self.moe_add_bias_linear and self.hidden_size % etp:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"megatron.expert_tensor_parallel_size={etp}, which splits the experts' fc2 biases "
                              "(moe_add_bias_linear) over their hidden columns; choose an ETP size that divides it")
        if self.moe_ffn_hidden_size % etp:
            raise ConfigError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not divisible by "
                              f"megatron.expert_tensor_parallel_size={etp}; choose an ETP size that divides it")
        if self.fp8 is not None and self.fp8_recipe == "blockwise" and self.moe_ffn_hidden_size % (128 * etp):
            raise ConfigError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not a multiple of 128 x "
                              f"expert_tensor_parallel_size={128 * etp}, which fp8_recipe \"blockwise\" tiles each "
                              "rank's share of an expert by; choose a size that is, or fp8_recipe \"tensorwise\"")

    def check_layout(self, layout) -> None:
        """This model fits the ``ParallelLayout`` (ConfigError naming the fields otherwise)."""
        self.check_tensor_parallel(layout.tp)
        self.check_expert_parallel(layout.ep, layout.etp)
        if layout.cp > 1:
            self.check_context_parallel(layout.cp, layout.tp)
        if layout.pp > self.num_layers:
            raise ConfigError(f"model.num_layers={self.num_layers} is below megatron.pipeline_model_parallel_size="
                              f"{layout.pp}: every stage needs a transformer layer; lower the pipeline size")

    def check_context_parallel(self, cp: int, tp: int) -> None:
        check_context_parallel_seq_length(self.seq_length, cp, tp, self.sequence_parallel)
        if self.cp_comm_type == "a2a" and (self.num_attention_heads // tp) % cp:
            raise ConfigError(f"model.cp_comm_type \"a2a\" splits each TP rank's {self.num_attention_heads // tp} "
                              f"attention heads over context_parallel_size={cp}, which must divide them; use "
                              "cp_comm_type \"p2p\" or a context_parallel_size that divides the heads")
        if self.attention_dropout > 0:
            raise ConfigError(f"model.attention_dropout={self.attention_dropout} with context_parallel_size={cp}: the "
                              "context-parallel attention has no dropout; set model.attention_dropout to 0")

    def check_tensor_parallel(self, tp: int) -> None:
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"model.{name}={getattr(self, name)} is not divisible by "
                                  f"tensor_model_parallel_size={tp}; choose a TP size that divides it")
        groups = self.query_groups
        if groups % tp and tp % groups:
            # KV heads either split over TP or each is replicated on tp / groups ranks.
            raise ConfigError(f"model.num_query_groups={groups} and tensor_model_parallel_size={tp} do not divide one "
                              "another; the KV heads must split evenly over TP or be replicated evenly: choose a TP "
                              "size that divides num_query_groups or is a multiple of it")
        if self.moe_shared_expert_intermediate_size and self.moe_shared_expert_intermediate_size % tp:
            raise ConfigError(f"model.moe_shared_expert_intermediate_size={self.moe_shared_expert_intermediate_size} "
                              f"is not divisible by tensor_model_parallel_size={tp}; choose a TP size that divides it")
        if self.fp8_recipe == "blockwise" and self.fp8 is not None:
            widths = {"ffn_hidden_size": self.ffn_hidden_size,
                      "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size or 0}
            if self.multi_latent_attention:  # the up-projections' outputs and o_proj's input, split by heads
                a, qk, v = self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
                widths.update({"num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim)": a * qk,
                               "num_attention_heads * (qk_head_dim + v_head_dim)": a * (self.qk_head_dim + v),
                               "num_attention_heads * v_head_dim": a * v})
            else:
                widths.update({"num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
                               "num_query_groups * head_dim": self.query_groups * self.head_dim})
            for name, width in widths.items():
                if width % (128 * tp) and not (name.startswith("num_query") and self.query_groups < tp):
                    raise ConfigError(f"model.{name}={width} is not a multiple of 128 x tensor_model_parallel_size"
                                      f"={128 * tp}, which fp8_recipe \"blockwise\" tiles each rank's share by; "
                                      "choose sizes that are, or fp8_recipe \"tensorwise\"")
        if self.sequence_parallel and self.seq_length % tp:
            raise ConfigError(f"model.seq_length={self.seq_length} is not divisible by tensor_model_parallel_size={tp}, "
                              "which sequence parallelism needs")
