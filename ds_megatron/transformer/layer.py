"""One pre-LayerNorm transformer layer: x + attn(ln(x)), then x + mlp(ln(x)).

With ``post_sublayer_norms`` (Gemma 2 / 3) the attention's and the MLP's outputs are normalized too before
their residual adds: x + ln(attn(ln(x))), then x + ln(mlp(ln(x))).

Under sequence parallelism the LayerNorms, dropouts and residual adds run on
this rank's slice of the sequence ([s/tp, b, h]); their dropout therefore
uses the model-parallel RNG (different slices, different masks), and the
LayerNorm parameters are marked ``sequence_parallel`` because each rank sees
only part of the sequence when computing their gradients.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..parallel_state import ParallelGroup
from ..tensor_parallel import checkpoint
from .attention import ParallelAttention
from .multi_latent_attention import MLASelfAttention
from .norm import build_norm
from .packed_seq_params import PackedSeqParams


class GraphableLayer(torch.nn.Module):
    """A transformer layer split into the pieces a partial CUDA graph captures (Megatron's ``GraphableMegatronModule``).

    ``forward(h) = post_mlp(a, mlp(pre_mlp(a)))`` with ``a = forward_attention(h)``;
    ``mlp`` is the layer's MLP (dense or MoE).  Graph capture
    (``ds_megatron.cuda_graphs``) recognizes a layer by this base class, an
    explicit interface: a structural check over module attributes depends on
    the Python version (from 3.12 ``isinstance`` against a runtime Protocol looks
    attributes up statically and misses submodules held in ``_modules``).
    """

    mlp: torch.nn.Module

    def forward_attention(self, hidden: torch.Tensor,
                          packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """Input LayerNorm, attention and its residual add."""
        raise NotImplementedError

    def pre_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """What feeds the MLP (the pre-MLP LayerNorm)."""
        raise NotImplementedError

    def post_mlp(self, hidden: torch.Tensor, mlp_output: torch.Tensor) -> torch.Tensor:
        """The MLP's residual add (and dropout)."""
        raise NotImplementedError

    def run_mlp(self, hidden: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """The MLP; a packed micro-batch's documents go with the tokens (an MoE router needs them)."""
        return self.mlp(hidden) if packed_seq_params is None else self.mlp(hidden, packed_seq_params)

    def forward(self, hidden: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        hidden = self.forward_attention(hidden, packed_seq_params)
        return self.post_mlp(hidden, self.run_mlp(self.pre_mlp(hidden), packed_seq_params))


class ParallelTransformerLayer(GraphableLayer):
    """``config``: a ``GPTConfig``; ``tp``: the tensor-parallel group; ``build_mlp``: makes the layer's MLP
    (a ``ParallelMLP``, or an MoE layer on the expert groups; the model that owns the layer decides), called
    after attention so that weights are drawn in Megatron's order whatever the MLP is.  ``layer_number``: the
    layer's index in the whole model (0-based; its attention window and RoPE base follow it)."""

    def __init__(self, config, *, tp: ParallelGroup, build_mlp: Callable[[], torch.nn.Module], init_method,
                 output_init_method, rng_tracker=None, cp: Optional[ParallelGroup] = None, hierarchical_cp=None,
                 layer_number: int = 0):
        super().__init__()
        h = config.hidden_size
        sp = config.sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.rng_tracker = rng_tracker
        # Megatron's full activation recomputation ("full"): the layer keeps only its input (its owner turns
        # it off for the layers recompute_method "block" leaves out: set_recompute_method).  "selective":
        # only the named modules are rerun in backward ("mlp" a dense MLP, "moe" an MoE layer, as Megatron's).
        self.recompute = config.recompute_granularity == "full"
        modules = set(config.recompute_modules or ()) if config.recompute_granularity == "selective" else set()
        self.recompute_mlp = ("moe" if config.is_moe_layer(layer_number) else "mlp") in modules
        self.recompute_layernorm = "layernorm" in modules
        self.mlp_sequence_tiles = config.mlp_sequence_tiles
        self.input_layernorm = build_norm(config, h, sequence_parallel=sp)
        if config.multi_latent_attention:
            attention = MLASelfAttention
        else:
            attention = functools.partial(ParallelAttention, layer_number=layer_number)
        self.self_attention = attention(config, tp=tp, init_method=init_method,
                                        output_init_method=output_init_method, rng_tracker=rng_tracker, cp=cp,
                                        hierarchical_cp=hierarchical_cp)
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if config.post_sublayer_norms:
            self.post_self_attn_layernorm = build_norm(config, h, sequence_parallel=sp)
        self.post_attention_layernorm = build_norm(config, h, sequence_parallel=sp)  # the MLP's input norm
        self.mlp = build_mlp()
        if config.post_sublayer_norms:
            self.post_mlp_layernorm = build_norm(config, h, sequence_parallel=sp)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0:
            return x
        fork = self.rng_tracker.fork() if (self.sequence_parallel and self.rng_tracker is not None) \
            else contextlib.nullcontext()
        with fork:
            return F.dropout(x, p=self.hidden_dropout, training=True)

    def _selective(self, on: bool, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if on and self.training and torch.is_grad_enabled():
            return checkpoint(module, self.rng_tracker, x)  # keeps x, reruns module in backward
        return module(x)

    def forward_attention(self, hidden: torch.Tensor,
                          packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        normed = self._selective(self.recompute_layernorm, self.input_layernorm, hidden)
        out = self.self_attention(normed, packed_seq_params)
        if self.post_self_attn_layernorm is not None:
            out = self._selective(self.recompute_layernorm, self.post_self_attn_layernorm, out)
        return hidden + self._dropout(out)

    def pre_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._selective(self.recompute_layernorm, self.post_attention_layernorm, hidden)

    def post_mlp(self, hidden: torch.Tensor, mlp_output: torch.Tensor) -> torch.Tensor:
        if self.post_mlp_layernorm is not None:
            mlp_output = self._selective(self.recompute_layernorm, self.post_mlp_layernorm, mlp_output)
        return hidden + self._dropout(mlp_output)

    def forward(self, hidden: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """``packed_seq_params``: the documents of a packed micro-batch (attention within each, MoE routing)."""
        packed = packed_seq_params
        if self.recompute and self.training and torch.is_grad_enabled():
            # Rerun in backward, replaying the default generator and the tracker's streams (the same
            # dropout masks).  Inside the layer, so that every owner (GPTModel, a pipeline stage) gets it.  The
            # rerun tiles the MLP as the forward did (each tile's checkpoint nested in the layer's), so its
            # intermediates stay one tile's in the layer's backward and fp8 scales each tile as the forward did.
            return checkpoint(self._forward, self.rng_tracker, hidden, packed)
        return self._forward(hidden, packed)

    def _forward(self, hidden: torch.Tensor, packed: Optional[PackedSeqParams]) -> torch.Tensor:
        """The layer with its MLP tiled, recomputed (selective ``mlp``) or plain."""
        if self.mlp_sequence_tiles > 1 and self.training and torch.is_grad_enabled():
            hidden = self.forward_attention(hidden, packed)
            return self.post_mlp(hidden, self._tiled_mlp(self.pre_mlp(hidden)))  # dense MLPs only: per token
        if self.recompute_mlp:
            hidden = self.forward_attention(hidden, packed)
            mlp = functools.partial(self.run_mlp, packed_seq_params=packed)
            return self.post_mlp(hidden, self._selective(True, mlp, self.pre_mlp(hidden)))
        return super().forward(hidden, packed)

    def _tiled_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over sequence tiles of ``x [s, b, h]``, each kept as its input and rerun in backward: the
        [tile, b, ffn] intermediates exist one tile at a time.  Per token, so the tiles' order (under sequence
        parallelism each rank's tile t is gathered with the others' tile t) does not matter."""
        tiles = torch.tensor_split(x, min(self.mlp_sequence_tiles, x.size(0)), dim=0)
        return torch.cat([checkpoint(self.mlp, self.rng_tracker, t) for t in tiles], dim=0)


def set_recompute_method(layers, config) -> None:
    """Full recomputation by ``recompute_method``: of an owner's layers in order (the model's, a pipeline
    stage's or a chunk's), "block" recomputes the first ``recompute_num_layers``, "uniform" every one."""
    for index, layer in enumerate(layers):
        if isinstance(layer, ParallelTransformerLayer):
            layer.recompute = config.recomputes_layer(index)
