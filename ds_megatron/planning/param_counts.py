"""The parameters each rank holds, from the model config and the layout alone (pure, no torch).

Megatron's layouts as arithmetic: the TP-split weights (QKV with KV heads split
over TP or, with fewer KV groups than TP ranks, one group replicated per rank;
the output projection; the MLP), the replicated ones (norms, row-parallel
biases, the router and its bias), the attention sinks (split by heads), and the experts
(``num_experts / EP`` per rank, each split over ETP; their biases with ``moe_add_bias_linear``).
``planning.memory`` turns the counts into bytes,
``planning.comm_volume`` into gradient traffic, and the pipeline split by
parameters (``pipeline_stage_layers``, used by ``integration.pipeline`` as
well) weighs each layer by them; ``tests/optimizer/test_planning.py`` holds
them to the parameters a built model has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..config.model import pad_vocab_size
from ..config.pipeline import stage_layer_counts, stage_layer_ranges


@dataclass(frozen=True)
class ParamCounts:
    """Parameters one rank holds: its shards of the TP-split weights, its copy of the replicated ones,
    and its local experts (``num_experts / EP`` of them, each split over ETP)."""

    sharded: int
    replicated: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.expert


def _mlp_counts(h: int, ffn: int, tp: int, gated: bool = False, bias: bool = True) -> ParamCounts:
    """A ``ParallelMLP``: column h->ffn (x2 gated; weight + bias split), row ffn->h (weight split, bias replicated)."""
    fc1 = (2 if gated else 1) * (ffn // tp)
    return ParamCounts(sharded=fc1 * (h + int(bias)) + h * (ffn // tp), replicated=h if bias else 0)


def norm_params(cfg, width: Optional[int] = None) -> int:
    """A norm over ``width`` (default: the hidden size) features: RMSNorm's weight, or LayerNorm's weight and bias."""
    width = cfg.hidden_size if width is None else width
    return width if cfg.normalization == "RMSNorm" else 2 * width


def mla_counts(cfg, tp: int) -> ParamCounts:
    """Multi-latent attention: the up-projections (q_proj or q_b_proj, kv_b_proj) and o_proj split by heads; the
    down-projections (biased with add_bias_linear), the latent norms and o_proj's bias replicated."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads // tp, int(cfg.add_bias_linear)
    qk, pos, v, kv_rank = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_in = h if cfg.q_lora_rank is None else cfg.q_lora_rank
    sharded = q_in * heads * (qk + pos) + kv_rank * heads * (qk + v) + heads * v * h
    replicated = (h + bias) * (kv_rank + pos) + norm_params(cfg, kv_rank) + bias * h
    if cfg.q_lora_rank is not None:
        replicated += (h + bias) * cfg.q_lora_rank + norm_params(cfg, cfg.q_lora_rank)
    return ParamCounts(sharded, replicated)


def layer_counts(cfg, layer: int, tp: int, ep: int = 1, etp: int = 1) -> ParamCounts:
    """Transformer layer ``layer``'s parameters on one rank (dense or MoE, as ``cfg.is_moe_layer`` says)."""
    h, d, n, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
    qkv_rows = (n // tp + 2 * max(g // tp, 1)) * d  # KV heads split over TP, or one group's replicated
    sharded = qkv_rows * (h + int(cfg.qkv_bias)) + h * (n * d // tp)  # QKV (weight + bias), output projection
    sharded += n // tp if cfg.softmax_type == "learnable" else 0  # the attention sinks of the rank's heads
    replicated = ((4 if cfg.post_sublayer_norms else 2) * norm_params(cfg) + (h if cfg.add_bias_linear else 0)
                  + (2 * norm_params(cfg, d) if cfg.qk_layernorm else 0))
    if cfg.multi_latent_attention:  # its projections instead of QKV and dense; the two layer norms as before
        mla = mla_counts(cfg, tp)
        sharded, replicated = mla.sharded, 2 * norm_params(cfg) + mla.replicated
    expert = 0
    if cfg.is_moe_layer(layer):
        replicated += cfg.num_experts * (h + int(cfg.moe_add_bias_linear))  # router
        fc1 = 2 if cfg.gated_linear_unit else 1
        expert += (cfg.num_experts // ep) * (fc1 + 1) * h * (cfg.moe_ffn_hidden_size // etp)  # fc1, fc2
        if cfg.moe_add_bias_linear:  # fc1's split with its rows, fc2's over the hidden columns (moe/experts.py)
            expert += (cfg.num_experts // ep) * (fc1 * cfg.moe_ffn_hidden_size + h) // etp
        if cfg.moe_shared_expert_intermediate_size:
            shared = _mlp_counts(h, cfg.moe_shared_expert_intermediate_size, tp, cfg.gated_linear_unit,
                                 cfg.add_bias_linear)
            sharded, replicated = sharded + shared.sharded, replicated + shared.replicated
            replicated += h if cfg.moe_shared_expert_gate else 0
    else:
        mlp = _mlp_counts(h, cfg.ffn_hidden_size, tp, cfg.gated_linear_unit, cfg.add_bias_linear)
        sharded, replicated = sharded + mlp.sharded, replicated + mlp.replicated
    return ParamCounts(sharded, replicated, expert)


def layer_param_count(cfg, layer: int, tp: int, ep: int = 1, etp: int = 1) -> int:
    """All of layer ``layer``'s parameters on one rank (the weight of ``pipeline_partition_method`` "parameters")."""
    return layer_counts(cfg, layer, tp, ep, etp).total


def gpt_param_counts(cfg, tp: int, ep: int = 1, etp: int = 1, layers: Optional[Sequence[int]] = None,
                     first_stage: bool = True, last_stage: bool = True) -> ParamCounts:
    """The GPT's parameters on one rank: the whole ``GPTModel`` by default, or one pipeline stage's share
    (``layers``; the embedding on the first stage, the final LayerNorm and the tied output copy on the last)."""
    h = cfg.hidden_size
    vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
    sharded, replicated, expert = 0, 0, 0
    untied, mtp = cfg.untie_embeddings_and_output_weights, bool(cfg.mtp_num_layers)
    # The word embedding, with a copy on the last stage of a pipeline when tied or when multi-token prediction
    # embeds tokens there (the learned positions too)
    if first_stage or (last_stage and (mtp or not untied)):
        sharded += (vocab // tp) * h
    if (first_stage or (last_stage and mtp)) and cfg.position_embedding_type == "learned_absolute":
        replicated += cfg.seq_length * h
    if last_stage:
        replicated += norm_params(cfg)  # final norm
        sharded += (vocab // tp) * h if untied else 0  # the output layer
        for k in range(cfg.mtp_num_layers or 0):  # multi-token prediction: enorm, hnorm, eh_proj, a layer, a norm
            layer = layer_counts(cfg, cfg.num_layers + k, tp, ep, etp)  # MoE when the last decoder layer is
            sharded += 2 * h * h // tp + layer.sharded
            replicated += 3 * norm_params(cfg) + layer.replicated
            expert += layer.expert
    for layer in (range(cfg.num_layers) if layers is None else layers):
        counts = layer_counts(cfg, layer, tp, ep, etp)
        sharded, replicated, expert = (sharded + counts.sharded, replicated + counts.replicated,
                                       expert + counts.expert)
    return ParamCounts(sharded, replicated, expert)


def pipeline_stage_layers(cfg, layout, partition_method: str = "uniform",
                          layers_per_stage: Optional[Sequence[int]] = None, first: Optional[int] = None,
                          last: Optional[int] = None, vpp: int = 1) -> List[range]:
    """The transformer layers of each pipeline stage, or with ``vpp`` > 1 of each of the ``pp * vpp`` virtual
    stages (``config.pipeline``'s split: ``partition_method`` "uniform", "parameters" (weighed by
    ``layer_param_count`` at this layout), explicit ``layers_per_stage``, or Megatron's first / last stage counts)."""
    weights = None
    if partition_method == "parameters" and layers_per_stage is None:
        weights = [layer_param_count(cfg, i, layout.tp, layout.ep, layout.etp) for i in range(cfg.num_layers)]
    return stage_layer_ranges(stage_layer_counts(cfg.num_layers, layout.pp, partition_method, layers_per_stage,
                                                 weights, vpp=vpp, first=first, last=last))


def pipeline_rank_chunks(cfg, layout, partition_method: str = "uniform",
                         layers_per_stage: Optional[Sequence[int]] = None, first: Optional[int] = None,
                         last: Optional[int] = None, vpp: int = 1) -> List[List[range]]:
    """Per pipeline rank, the layers of each of its ``vpp`` chunks (local chunk ``c`` is virtual stage
    ``c * pp + rank``)."""
    virtual = pipeline_stage_layers(cfg, layout, partition_method, layers_per_stage, first, last, vpp)
    return [[virtual[c * layout.pp + rank] for c in range(vpp)] for rank in range(layout.pp)]
