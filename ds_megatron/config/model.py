"""``GPTConfig``: the ``megatron.model`` section of a job (pure Python, checked before launch).

``check_layout`` checks the model against a parallel layout (heads and MLP
widths divisible by TP, experts by EP, ...): the one place these rules live.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    sequence_parallel: bool = False
    label_smoothing: float = 0.0
    # Megatron's activation recomputation: None, or "full" (every layer's activations are
    # recomputed in backward, through DeepSpeed's activation checkpointing).
    recompute_granularity: Optional[str] = None
    # MoE (ds_megatron/moe; Megatron-LM's argument names)
    num_experts: Optional[int] = None  # None: a dense model
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_layer_freq: int = 1  # every k-th layer (0, k, 2k, ...) is an MoE layer
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax before top-k instead of over the chosen k
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: Optional[float] = None  # None: no token dropping
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    # GroupedMLP / SequentialMLP; None: the faster for the device (grouped with CUDA, sequential on CPU:
    # launch/bench/bench_moe.py)
    moe_grouped_gemm: Optional[bool] = None

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self._check_moe()
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_attention_heads={self.num_attention_heads}; pick sizes that divide")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.recompute_granularity not in (None, "full"):
            raise ConfigError(f"model.recompute_granularity={self.recompute_granularity!r} is not supported; "
                              "use \"full\" or null")
        if self.recompute_granularity and self.num_experts:
            # The MoE layer keeps its routing losses from the forward; a recomputed forward would replace them.
            raise ConfigError("model.recompute_granularity is set together with model.num_experts; activation "
                              "recomputation is not supported for MoE models yet: set it to null")

    # MoE
    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq"):
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
        if self.moe_pad_expert_input_to_capacity and self.moe_capacity_factor is None:
            raise ConfigError("model.moe_pad_expert_input_to_capacity is true but model.moe_capacity_factor is null; "
                              "padding fills experts to their capacity: set a capacity factor or turn padding off")

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` (0-based) uses an MoE MLP (Megatron's integer moe_layer_freq)."""
        return self.num_experts is not None and layer_index % self.moe_layer_freq == 0

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
        if self.moe_ffn_hidden_size % etp:
            raise ConfigError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not divisible by "
                              f"megatron.expert_tensor_parallel_size={etp}; choose an ETP size that divides it")

    def check_layout(self, layout) -> None:
        """This model fits the ``ParallelLayout`` (ConfigError naming the fields otherwise)."""
        self.check_tensor_parallel(layout.tp)
        self.check_expert_parallel(layout.ep, layout.etp)
        if layout.cp > 1:
            raise ConfigError("GPTModel supports tensor, sequence, pipeline, expert and data parallelism; set "
                              "megatron.context_parallel_size to 1 for it")
        if layout.pp > self.num_layers:
            raise ConfigError(f"model.num_layers={self.num_layers} is below megatron.pipeline_model_parallel_size="
                              f"{layout.pp}: every stage needs a transformer layer; lower the pipeline size")

    def check_tensor_parallel(self, tp: int) -> None:
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"model.{name}={getattr(self, name)} is not divisible by "
                                  f"tensor_model_parallel_size={tp}; choose a TP size that divides it")
        if self.sequence_parallel and self.seq_length % tp:
            raise ConfigError(f"model.seq_length={self.seq_length} is not divisible by tensor_model_parallel_size={tp}, "
                              "which sequence parallelism needs")
