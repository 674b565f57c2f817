"""Bytes each rank puts on the wire per training step, from the config alone (pure, no torch).

The formula of each layout, as nccl-tests counts bus bytes (all-reduce
2(n-1)/n of the tensor, all-gather and reduce-scatter (n-1)/n of the whole
tensor, a point-to-point send 1x), for a dense GPT on our optimizer path, per
step of ``micro_batches`` micro-batches of ``micro_batch`` samples
(``s = seq_length / cp`` tokens each on a rank, ``a`` bytes per activation
element in the params dtype):

* data parallel (over ``dp-cp``): one all-reduce of the fp32 gradients; with
  the distributed optimizer one reduce-scatter of them and one all-gather of
  the params (alignment padding, under 64 elements per param, left out);
* tensor parallel: per layer and micro-batch two all-reduces of ``s*b*h``
  forward and two backward (with sequence parallelism the same bytes as
  all-gathers and reduce-scatters), and with full recomputation the rerun's,
  which torch's checkpoint stops at the last tensor the backward needs: the
  first one (SP: two gathers and a reduce-scatter, the MLP's input gathered);
  both when hidden dropout or a post-MLP norm saves a tensor after the MLP;
  with MLP tiles the attention's and every tile's but the last (the last
  tile's checkpoint keeps its input before it runs); besides them the
  embedding's forward all-reduce (then scattered, with SP), the output layer's input gradient
  (its input all-gathered, with SP), the vocab-parallel cross entropy's
  ``3*b*s`` floats, and once per step the gradients that are partial sums over
  TP: the replicated norms and biases with SP, the q/k norms and multi-latent
  attention's down-projections and latent norms always, and with more TP ranks
  than KV groups the KV projection's copies (each group's slot in one buffer
  of all groups, summed over TP);
* multi-token prediction, on the last stage per depth: one more embedding,
  layer and head, and ``eh_proj``'s [2h] input and [h] output (its copies of
  the word and learned position embeddings summed over the ``embedding``
  group with a pipeline, untied too);
* context parallelism: per layer and micro-batch ``cp - 1`` K/V blocks forward
  and ``cp - 1`` K/V blocks and dK/dV accumulators (fp32 for 16-bit models; MLA's K and V each
  its own width)
  backward on the ring, or one all-gather and one reduce-scatter of them (the
  forward's exchange again with full recomputation);
  with ``cp_comm_type "a2a"`` (Ulysses) q, k, v and the attention output
  all-to-all'd forward and their gradients backward ((cp-1)/cp of each, K/V
  expanded to the query heads when fewer than cp); with ``"a2a+p2p"`` the
  all-to-all inside the inner groups and the ring of the a2a'd K/V across
  them; the loss's sum and token
  count over ``cp``;
* pipeline: per micro-batch the stage's output hidden states forward (all
  stages but the last) and their gradient backward (all but the first); with
  v chunks per rank (our runtime) the same per chunk, for virtual stages
  ``c * pp + rank`` (the same messages with every schedule: ZB-H1 only moves
  W), and the mean loss our runtime reports (one float over dp, one over pp);
  the tied embedding's gradient summed over the first and last stage once;
* the optimizer: one float64 (inf flag and squared norm) over the ranks that
  hold different parts of the model;
* fp8: tensorwise, per fp8 linear and micro-batch the amaxes of its input and
  weight all-reduced (MAX) over TP x CP forward, its output gradient's backward
  (the MLP's tiles each their own), and again each rerun forward's
  (recomputation); delayed, once per step each fp8 linear's three amaxes over
  TP, then dp-cp; blockwise, nothing; with ``fp8_param_gather`` the fp8 layers'
  weights all-gathered as one byte an element, the input's amax alone forward,
  and once per step the fp8 weights' amaxes (a float each) over dp-cp and TP;
  MLA's five (four) fp8 linears a layer's attention, its replicated
  down-projections' weights never fp8 parameters.

* MoE layers (``_moe_bus_bytes``), for balanced routing: each rank's experts
  receive as many token copies as the rank routes (``T * topk`` rows for its
  ``T = s*b/tp`` tokens, dropless); per layer and micro-batch, with the
  ``alltoall`` dispatcher, the per-expert counts all-gathered (int64) over
  ``ep`` then ``etp``, and the rows (hidden states and their one routing
  weight each, in the params dtype) all-to-all'd over ``ep`` and all-gathered
  over ``etp`` forward, back by the ``etp`` reduce-scatter and the reverse
  all-to-all, the same four again in backward; with ``allgather`` every
  token, its weights and routing map gathered over ``etp-ep`` and the
  output reduce-scattered (exact whatever the routing).  The layer's
  attention keeps its TP traffic, its MLP's is the shared expert's (a dense
  MLP); without sequence parallelism each TP rank dispatches its slice of the
  tokens (their gradient and weights' gathered in backward, the output
  gathered forward).  The router's reductions over its sequence group
  (``tp-cp`` with SP, else ``cp``): the z-loss, the balancing loss's counts
  and value (over ``dp`` too for ``global_aux_loss``), once per step the
  expert bias's counts (fp32, every MoE layer of the stage) over it and
  ``dp``.  Expert gradients are reduced over ``edp`` as the dense ones over
  ``dp-cp`` (distributed optimizer: reduce-scatter and all-gather), and the
  optimizer's float64 goes over the expert-model-parallel group too when its
  ranks differ.  A recomputed MoE layer (full, selective ``moe``) reruns its
  forward to the un-permuting scatter-add (``MoEReruns``): the shared expert,
  the router's reductions, the counts, the dispatch and the combine again (the
  all-gather dispatcher's gathers, not its output's reduce-scatter).  Token
  dropping (``moe_capacity_factor``) and fp8 are refused (MLP tiles the config
  refuses with MoE).  Under ``"full"`` a multi-token-prediction layer is
  recomputed whole whatever ``recompute_method`` says (its owner applies none).

``tests/test_bytes_on_wire.py`` counts the collectives of real steps and holds
them to these figures; ``launch/bench/bench_vs_peers.py`` prints both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config.model import pad_vocab_size
from ..errors import ConfigError
from .memory import BYTES, attention_fp8_linears, fp8_weight_elements, kv_heads_per_rank, mlp_tiles
from .param_counts import gpt_param_counts, layer_counts, mla_counts, norm_params, pipeline_rank_chunks

F32, F64 = 4, 8


def _all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def _gather_or_scatter(n: int, nbytes: float) -> float:
    return (n - 1) / n * nbytes if n > 1 else 0.0


def _full_rerun_mlp(cfg, rows: int) -> Tuple[Optional[float], int]:
    """How far the rerun of a fully recomputed layer goes through its MLP (``rows``: the MLP input's rows on a rank):
    the share of the rows it carries through the whole MLP, to fc2's output reduction (None: the untiled MLP's rerun
    stops at fc2's saved input, past fc1's input gather), and the MLP's fp8 linear forwards it runs.  Torch's
    checkpoint stops at the last tensor the layer's backward needs: one saved after the MLP (hidden dropout's mask,
    the post-MLP norm's input) takes the rerun through all of it; else, with tiles, the last tile's input, kept by
    its own checkpoint before it runs, so every tile before it has run whole."""
    tiles = mlp_tiles(cfg, rows)
    if cfg.hidden_dropout > 0 or cfg.post_sublayer_norms:
        return 1.0, 2 * tiles
    if tiles > 1:
        return (rows - rows // tiles) / rows, 2 * (tiles - 1)
    return None, 2


@dataclass(frozen=True)
class StageComm:
    """Bus bytes per step of every rank of one pipeline stage, by group kind (``tp``, ``cp`` (and its hierarchical
    ``hcp-a2a`` / ``hcp-p2p``), ``dp-cp``, ``pp``,
    ``embedding``, and ``optimizer`` for the norm's one scalar)."""

    stage: int
    bus_bytes: Dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.bus_bytes.values())


def plan_comm_volume(cfg, layout, params_dtype: str = "fp32", micro_batch: int = 1, micro_batches: int = 1,
                     distributed_optimizer: bool = False, partition_method: str = "uniform",
                     layers_per_stage: Optional[Sequence[int]] = None, first: Optional[int] = None,
                     last: Optional[int] = None, num_model_chunks: int = 1,
                     deepspeed_engine: bool = False, hierarchical_inner: Optional[int] = None,
                     fp8_param_gather: bool = False) -> List[StageComm]:
    """One ``StageComm`` per pipeline stage (the ranks of a stage all move the same bytes); ``first`` / ``last``:
    Megatron's ``decoder_first/last_pipeline_num_layers``; ``num_model_chunks``: v; ``deepspeed_engine``: the
    stages run on DeepSpeed's ``PipelineEngine`` (a ``GPTPipelineModule``) instead of our runtime;
    ``hierarchical_inner``: the a2a size of ``hierarchical_context_parallel_sizes``."""
    _check_moe(cfg)
    t, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    a = BYTES[params_dtype]
    s, b, h, d = cfg.seq_length // cp, micro_batch, cfg.hidden_size, cfg.head_dim
    sp = cfg.sequence_parallel and t > 1
    # Layers recomputed whole ("full", by recompute_method), and selective "mlp" (its rerun reaches the fc1 input
    # gather under sequence parallelism, torch's early stop leaves fc2 out).
    # Tiled MLP reruns each tile in backward too; the tiled loss reruns its cross entropy's reductions.
    selective_mlp = (cfg.recompute_granularity == "selective" and "mlp" in (cfg.recompute_modules or ())
                     or cfg.mlp_sequence_tiles > 1)
    loss_passes = 2 if cfg.loss_sequence_tiles > 1 else 1
    sbh = s * b * h * a
    rows = s // t if sp else s  # the MLP input's rows on a rank, split into tiles
    tiles = mlp_tiles(cfg, rows)
    rerun_mlp, rerun_linears = _full_rerun_mlp(cfg, rows)
    v = num_model_chunks
    rank_chunks = pipeline_rank_chunks(cfg, layout, partition_method, layers_per_stage, first, last, v)
    kv_heads = kv_heads_per_rank(cfg, t)
    q_width, v_width = cfg.head_widths  # per head (multi-latent attention: its own)
    pair = b * s * (q_width + v_width)  # one head's k and v (or q and the output) of this rank's tokens, elements
    depths = cfg.mtp_num_layers or 0
    out = []
    for stage, chunks in enumerate(rank_chunks):
        layers = [i for chunk in chunks for i in chunk]
        first, last = stage == 0, stage == pp - 1
        # a multi-token-prediction layer is recomputed whole under "full" (its owner applies no recompute_method)
        mtp_full = depths if last and cfg.recompute_granularity == "full" else 0
        recomputed = sum(cfg.recomputes_layer(i) for chunk in chunks for i in range(len(chunk)))
        counts = gpt_param_counts(cfg, t, layout.ep, layout.etp, layers=layers, first_stage=first, last_stage=last)
        m, n_layers = micro_batches, len(layers)
        vol: Dict[str, float] = {}

        def add(kind: str, nbytes: float) -> None:
            if nbytes:
                vol[kind] = vol.get(kind, 0.0) + nbytes

        # Gradients and, with the distributed optimizer, params, over dp-cp (the buffers hold fp32 grads).
        dense = counts.total - counts.expert  # the experts' gradients go over edp (_moe_bus_bytes)
        grads = dense * F32
        mtp_layers = [cfg.num_layers + k for k in range(depths)] if last else []

        def recomputed_whole(kind) -> int:
            """The stage's layers ``kind`` picks that rerun whole: by recompute_method, and under "full" its MTP
            layers."""
            return (sum(cfg.recomputes_layer(j) and kind(i) for chunk in chunks for j, i in enumerate(chunk))
                    + (sum(kind(i) for i in mtp_layers) if mtp_full else 0))

        # blockwise scales need no collective
        # a layer's fp8 linears: its attention's (MLA: five or four, the replicated down-projections' weights never
        # fp8 parameters), fc1 and fc2
        attention = attention_fp8_linears(cfg, t)
        per_layer, replicated = len(attention) + 2, sum(not split for *_, split in attention)
        fp8_layers = sum(cfg.fp8_layer(i) for i in layers + mtp_layers)
        fp8_linears = per_layer * fp8_layers if cfg.fp8_recipe == "tensorwise" else 0
        fp8_weights = fp8_weight_elements(cfg, layers, t, last) if fp8_param_gather else 0
        if distributed_optimizer:
            params = (dense - fp8_weights) * a + fp8_weights  # fp8 weights: one byte each
            add("dp-cp", _gather_or_scatter(dp * cp, grads) + _gather_or_scatter(dp * cp, params))
        else:
            add("dp-cp", _all_reduce(dp * cp, grads))
        if cfg.fp8 is not None and cfg.fp8_recipe == "delayed":
            # once per step each fp8 linear's three amaxes (input, weight, output gradient) over TP, then dp-cp
            # (fp8.delayed_scaling_groups); its GEMMs use the step's scales, with no collective per micro-batch
            delayed = per_layer * fp8_layers * 3 * F32
            add("tp", _all_reduce(t, delayed))
            add("dp-cp", _all_reduce(dp * cp, delayed))
        if fp8_param_gather:  # the amax of each fp8 weight, agreed over its shards' ranks and TP once per step
            weights = (per_layer - replicated) * fp8_layers * F32
            add("dp-cp", _all_reduce(dp * cp, weights))
            add("tp", _all_reduce(t, weights))
        # fp8 tensorwise: each linear's amaxes over its amax group (TP x CP), forward (input and weight; the input's
        # alone when the weight comes quantized) and backward (output gradient); the MLP's tiles each quantize
        # their own tokens.  A rerun forward reduces again: a layer recomputed whole reruns its attention's linears
        # and its MLP's as far as _full_rerun_mlp says (untiled: both, the rerun stops at fc2's saved fp8 copies), a
        # recomputed or tiled MLP its two (each tile's, in a recomputed layer too).  A replicated
        # linear's weight is never an fp8 parameter: its forward reduces both amaxes.
        fp8_full = recomputed_whole(cfg.fp8_layer)
        n = fp8_layers if fp8_linears else 0
        calls = n * (len(attention) + 2 * tiles)
        reruns = (fp8_full * (len(attention) + rerun_linears) + (n * 2 * tiles if selective_mlp else 0)) if n else 0
        whole = n * replicated + (fp8_full * replicated if n else 0)  # forwards of replicated linears
        add("tp-cp", m * ((calls + reruns - whole) * _all_reduce(t * cp, (1 if fp8_param_gather else 2) * F32)
                          + whole * _all_reduce(t * cp, 2 * F32) + calls * _all_reduce(t * cp, F32)))
        # Tensor parallel activations.  A layer's forward reduces twice (SP: gathers its attention and MLP inputs,
        # reduce-scatters their outputs), its backward as much again.  Full recomputation reruns the forward up to
        # the last tensor the backward needs (torch's early stop): the attention's reduction (SP: gather and
        # reduce-scatter) and the MLP's share (_full_rerun_mlp; untiled without a later save, SP's gather of its
        # input alone).  The embedding is all-reduced (SP: then scattered, gathered in
        # backward); the output layer's input gradient is reduced (SP: its input gathered, the gradient scattered).
        ar, g = _all_reduce(t, sbh), _gather_or_scatter(t, sbh)
        # Each multi-token-prediction depth (last stage): the embedding's, its layer's and a head's, and eh_proj's
        # [2h] input reduced in backward (SP: gathered, its gradient scattered), its output gathered over TP
        # (SP: then scattered over the sequence, gathered in backward).
        if sp:
            # a fully recomputed layer's rerun: attention's gather and reduce-scatter, and the MLP's share
            rerun = 2 * g + (g if rerun_mlp is None else 2 * g * rerun_mlp)
            layer_bytes = n_layers * 8 * g + recomputed * rerun + (n_layers * g if selective_mlp else 0)
            ends = (ar + g) * first + 2 * g * last
            mtp = depths * ((ar + g) + 6 * g + 8 * g + 2 * g + (g if selective_mlp else 0)) + mtp_full * rerun
        else:
            layer_bytes = n_layers * 4 * ar + recomputed * ar * (1 + (rerun_mlp or 0))
            ends = ar * (first + last)
            mtp = depths * (ar + 2 * ar + g + 4 * ar + ar) + mtp_full * ar * (1 + (rerun_mlp or 0))
        add("tp", m * (layer_bytes + ends + (mtp if last else 0)))
        if last:  # the cross entropy: the max, then the target logit and the sum of exponentials, in fp32
            add("tp", m * (1 + depths) * loss_passes * _all_reduce(t, 3 * s * b * F32))
        # Replicated weights whose gradients are partial sums over TP, summed once per step (in fp32).
        all_layers = n_layers + len(mtp_layers)
        if sp:  # norms and row-parallel biases see this rank's tokens only (the q/k norms its heads)
            partial = (sum(layer_counts(cfg, i, t).replicated for i in layers + mtp_layers)
                       + (norm_params(cfg) * (1 + 3 * len(mtp_layers)) if last else 0))
        else:  # the q/k norms and MLA's down-projections and latent norms see this rank's heads only
            partial = (2 * norm_params(cfg, d) if cfg.qk_layernorm else 0) * all_layers
            if cfg.multi_latent_attention:  # o_proj's bias is added after the reduction: whole on every rank
                partial += (mla_counts(cfg, t).replicated - h * int(cfg.add_bias_linear)) * all_layers
        if t > cfg.query_groups and not cfg.multi_latent_attention:  # each KV group's projection copies: every
            # group's slot in the same all-reduce
            partial += all_layers * cfg.query_groups * 2 * d * (h + int(cfg.qkv_bias))
        add("tp", _all_reduce(t, partial * F32))
        # Context parallelism: K/V of this rank's s tokens.
        if cp > 1 and cfg.cp_comm_type == "a2a+p2p":
            # Hierarchical: the all-to-all of q, k, v and the output inside groups of `inner` ranks (as "a2a"),
            # then the ring of the a2a'd K/V across the `cp / inner` groups (as "p2p", the same bytes per message).
            inner = hierarchical_inner or cp
            outer = cp // inner
            heads = cfg.num_attention_heads // t
            a2a_kv_heads = kv_heads if kv_heads % inner == 0 else heads
            moved = (heads + a2a_kv_heads) * pair
            add("hcp-a2a", m * (2 * n_layers + recomputed) * _gather_or_scatter(inner, moved * a))
            kv = a2a_kv_heads * pair
            acc = F32 if a < F32 else a
            add("hcp-p2p", m * (outer - 1) * kv * ((2 * n_layers + recomputed) * a + n_layers * acc))
            add("cp", m * _all_reduce(cp, 2 * F32) if last else 0)
        elif cp > 1 and cfg.cp_comm_type == "a2a":
            # Ulysses: q, k, v and the output all-to-all'd forward (again with recomputation), their gradients
            # backward; K/V with fewer heads than cp travel expanded to the query heads.
            heads = cfg.num_attention_heads // t
            a2a_kv_heads = kv_heads if kv_heads % cp == 0 else heads
            moved = (heads + a2a_kv_heads) * pair
            add("cp", m * (2 * n_layers + recomputed) * _gather_or_scatter(cp, moved * a))
            add("cp", m * _all_reduce(cp, 2 * F32) if last else 0)
        elif cp > 1:
            kv = kv_heads * pair
            acc = F32 if a < F32 else a
            # Forward (and its recomputation); the ring sends K/V again in backward, the all-gather keeps them.
            passes = n_layers * (1 + int(cfg.cp_comm_type == "p2p")) + recomputed
            add("cp", m * (cp - 1) * kv * (passes * a + n_layers * acc))
            add("cp", m * _all_reduce(cp, 2 * F32) if last else 0)
        # Pipeline: hidden states (this rank's slice with SP) forward from every virtual stage but the model's
        # last, their gradient backward from every one but the first.
        hidden = sbh / t if sp else sbh
        add("pp", m * hidden * (2 * v - last - first))
        if pp > 1 and not deepspeed_engine:  # our runtime's reported loss: the mean over dp, then to every stage
            add("dp", _all_reduce(dp, F32))
            add("pp", _all_reduce(pp, F32))
        if pp > 1 and (first or last) and (depths or not cfg.untie_embeddings_and_output_weights):
            # the word embedding's copy on the last stage (tied, or embedding MTP's tokens), and with MTP the
            # learned positions' copy
            vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, t)
            learned = cfg.position_embedding_type == "learned_absolute"
            add("embedding", _all_reduce(2, (vocab // t * h + (cfg.seq_length * h if depths and learned else 0))
                                         * F32))
        if cfg.num_experts:
            # MoE layers rerun in backward: recomputed whole (a multi-token-prediction layer always is, under
            # "full": its owner applies no recompute_method), or selective "moe"
            reruns = MoEReruns(recomputed_whole(cfg.is_moe_layer), rerun_mlp is not None, selective_mlp)
            for kind, nbytes in _moe_bus_bytes(cfg, layout, layers + mtp_layers, micro_batch, m, a, counts.expert,
                                               distributed_optimizer, reruns).items():
                add(kind, nbytes)
        holders = t * pp * (dp * cp if distributed_optimizer else 1)
        add("optimizer", _all_reduce(holders, F64))
        out.append(StageComm(stage, vol))
    return out


def _check_moe(cfg) -> None:
    """Refuse the MoE settings whose traffic the plan cannot count exactly (one line naming the setting)."""
    if not cfg.num_experts:
        return
    if cfg.moe_capacity_factor is not None:
        raise ConfigError(f"model.moe_capacity_factor={cfg.moe_capacity_factor}: which tokens are dropped (or "
                          "padded) depends on the routing; the communication plan covers dropless MoE "
                          "(moe_capacity_factor null)")
    if cfg.fp8 is not None:
        raise ConfigError(f"model.fp8={cfg.fp8!r} with num_experts: the communication plan does not count the "
                          "experts' fp8 amax reductions; plan the MoE model without fp8")


@dataclass(frozen=True)
class MoEReruns:
    """What a stage's MoE layers rerun in backward, beside what the dense count gives them: ``full``, how many are
    recomputed whole; ``through``, whether that rerun goes past the layer's MLP (a tensor saved after it:
    ``_full_rerun_mlp``); ``dense_mlp``, whether the dense count reran every layer's MLP (selective ``mlp``, which
    leaves MoE layers alone)."""

    full: int = 0
    through: bool = False
    dense_mlp: bool = False


def _moe_bus_bytes(cfg, layout, layers: Sequence[int], b: int, m: int, a: int, expert_params: int,
                   distributed_optimizer: bool, reruns: MoEReruns = MoEReruns()) -> Dict[str, float]:
    """The MoE layers' bus bytes per step on a rank holding ``layers`` (its decoder and MTP layers), by group kind,
    for balanced routing (see the module docstring); ``tp`` here is the change from counting every layer's MLP
    as dense.

    A rerun MoE layer (``reruns``) runs its forward again up to the last tensor its backward needs, the
    un-permuting scatter-add's indices (torch's checkpoint stops there): the shared expert whole, the router's
    reductions, and with the ``alltoall`` dispatcher the counts' gathers, the dispatch and the combine (the
    forward's half of the exchanges); with ``allgather`` the gathers of the tokens, their weights and routing
    map, not the output's reduce-scatter, which follows the scatter-add; without sequence parallelism the
    output's gather over TP only where the rerun goes past the layer."""
    t, ep, etp = layout.tp, layout.ep, layout.etp
    s, h, E, k = cfg.seq_length // layout.cp, cfg.hidden_size, cfg.num_experts, cfg.moe_router_topk
    sp = cfg.sequence_parallel and t > 1
    n = sum(cfg.is_moe_layer(i) for i in layers)
    selective = n if cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or ()) else 0
    reran = selective + reruns.full  # MoE forwards rerun per micro-batch
    out: Dict[str, float] = {}

    def add(kind: str, nbytes: float) -> None:
        if nbytes:
            out[kind] = out.get(kind, 0.0) + nbytes

    tokens = s * b // t  # the tokens this rank dispatches (its SP slice, or its share of the replicated ones)
    if cfg.moe_token_dispatcher_type == "allgather":
        g = etp * ep  # every token, its weights [E] and routing map (one byte each) gathered; back by reduce-scatter
        rows = _gather_or_scatter(g, g * tokens * h * a)
        weights, routing_map = _gather_or_scatter(g, g * tokens * E * a), _gather_or_scatter(g, g * tokens * E)
        add("etp-ep", m * n * (4 * rows + 2 * weights + routing_map) + m * reran * (rows + weights + routing_map))
    else:
        rows = tokens * k  # sent, and under balanced routing received
        forward = 2 * rows * h * a + rows * a  # hidden rows there and back; weights dispatched
        counts = ep * E * 8
        add("ep", m * (2 * n + reran) * _gather_or_scatter(ep, forward) + m * (n + reran) * _gather_or_scatter(
            ep, counts))
        add("etp", m * (2 * n + reran) * _gather_or_scatter(etp, etp * forward)
            + m * (n + reran) * _gather_or_scatter(etp, etp * counts))
    # TP: the MLP's reductions are the shared expert's (or none); without SP the slices are gathered.
    sbh = s * b * h * a
    ar, gs = _all_reduce(t, sbh), _gather_or_scatter(t, sbh)
    mlp = 4 * gs if sp else 2 * ar
    scatter = 0.0 if sp else 2 * gs + _gather_or_scatter(t, s * b * E * a)
    add("tp", m * n * (scatter - (0 if cfg.moe_shared_expert_intermediate_size else mlp)))
    # A rerun's TP: the shared expert's forward (SP: its input's gather and output's reduce-scatter), the output's
    # gather (no SP) where a whole layer's rerun goes past it; less what the dense count gave a rerun MLP (its
    # input's gather with SP, its whole forward past the MLP).
    shared = (2 * gs if sp else ar) if cfg.moe_shared_expert_intermediate_size else 0.0
    dense_full = (2 * gs if sp else ar) if reruns.through else (gs if sp else 0.0)
    add("tp", m * (reran * shared + reruns.full * ((0.0 if sp else gs) * reruns.through - dense_full)
                   - (n * gs if sp and reruns.dense_mlp else 0.0)))
    # The router's reductions over the sequence group, in its dtype (the loss values) or int64 / fp32 (counts).
    seq_kind, seq = ("tp-cp", t * layout.cp) if sp else ("cp", layout.cp)
    r = {None: a, "fp32": F32, "fp64": F64}[cfg.moe_router_dtype]
    router = _all_reduce(seq, r) if cfg.moe_z_loss_coeff > 0 else 0.0
    balancing = cfg.moe_router_load_balancing_type
    if cfg.moe_aux_loss_coeff > 0 and balancing != "none":
        counts = b * E * F32 if balancing == "seq_aux_loss" else E * 8
        router += _all_reduce(seq, counts) + _all_reduce(seq, r)
        if balancing == "global_aux_loss":
            add("dp", m * (n + reran) * (_all_reduce(layout.dp, E * 8) + _all_reduce(layout.dp, r)))
    add(seq_kind, m * (n + reran) * router)
    if cfg.moe_router_enable_expert_bias:  # once per step, all the stage's MoE layers' counts together
        add(seq_kind, _all_reduce(seq, n * E * F32))
        add("dp", _all_reduce(layout.dp, n * E * F32))
    # The experts' gradients over edp; the optimizer's float64 over the expert-model-parallel group too.
    if distributed_optimizer:
        add("edp", _gather_or_scatter(layout.edp, expert_params * F32) + _gather_or_scatter(layout.edp,
                                                                                             expert_params * a))
    else:
        add("edp", _all_reduce(layout.edp, expert_params * F32))
        groups = layout.group_ranks()  # (a stage without MoE layers joins it too)
        if {tuple(g) for g in groups["expert-model-parallel"]} != {tuple(g) for g in groups["model-parallel"]}:
            add("optimizer", _all_reduce(etp * ep * layout.pp, F64))
    return out


def format_comm_volume(stages: Sequence[StageComm]) -> str:
    """One line per stage: MB per step by group kind, and the total."""
    kinds = sorted({k for st in stages for k in st.bus_bytes})
    lines = ["bus MB per step per rank (nccl-tests bus bytes): " + (", ".join(kinds) if kinds else "none")]
    for st in stages:
        parts = ", ".join(f"{k} {st.bus_bytes[k] / 1e6:,.3f}" for k in kinds if k in st.bus_bytes)
        who = f"stage {st.stage}" if len(stages) > 1 else "every rank"
        lines.append(f"  {who}: {parts or '-'}; total {st.total / 1e6:,.3f}")
    return "\n".join(lines)
