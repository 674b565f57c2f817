"""Memory per rank of a GPT job, before launching it (``ds-megatron plan``, ``planning.report``).

Pure Python (no torch): the figures come from ``GPTConfig``, the parallel
layout and the precision settings, and are what a built ``GPTModel`` and our
optimizer path allocate on each rank (tests measure the tensors to check it).

Bytes per parameter, following Megatron's mixed-precision accounting:

* fp16/bf16 with Adam: model params 2 + grads 2 + fp32 main params 4 + Adam
  exp_avg 4 + exp_avg_sq 4 (+ fp32 main grads 4, alive during the step only);
* fp32 with Adam: params 4 + grads 4 + Adam 8 (no main copies);
* SGD keeps 4 bytes of momentum per param when momentum > 0, else nothing.

Activations per micro-batch are what our ``GPTModel`` keeps for backward, counted
tensor by tensor (``tests/optimizer/test_planning.py`` holds the count to the
allocations measured on CPU).  Per layer, by the layer's own widths
(``layer_activation_elements``): the two LayerNorm inputs and the two column-parallel
inputs (replicated), q/k/v (GQA's repeated to every head), the attention output
and its re-layout, the MLP's ffn-wide tensors (GELU: 2, gated: 4); at ffn = 4h
with GELU and MHA that is 4 + 13/t elements of ``s*b*h``, under sequence
parallelism 2 + 15/t (the LayerNorm inputs split, the column-parallel layers keep
their gathered input).  Multi-latent attention counts its latents and its own
q/k/v widths; MoE layers their routed tokens' tensors under balanced routing (each
TP rank's share, all-gathered over ETP: ``routed_tokens``); the last stage each
multi-token-prediction depth's layer, norms and head.

Where kernels differ by device, the plan follows the device it is made for, one
``planning.hardware.DeviceKernels`` passed down (``plan --hardware``'s; a CPU's by
default, which the tests measure).  Torch's fused attention keeps no ``s x s``
scores; with ``attention_dropout > 0`` CPU attention falls back to the math
kernel, which keeps three ``b*a/t*s*s`` tensors per layer and copies of q, k and
v, in fp32 for 16-bit models, and makes a fourth in backward
(``math_attention_bytes``); CUDA's flash / memory-efficient kernels keep no
``s x s`` tensor (the RNG state only).  Hidden dropout adds two masks per layer:
in the activations' dtype on a CPU, a byte an element on CUDA.  Besides the layers: the final LayerNorm's input and
the output layer's input, the ``s*b*V/t`` logits (the cross entropy works in
their storage; 16-bit logits get an fp32 copy), and the larger of the head's
two backward phases: the loss's (the logits) and the output layer's (the logits'
gradient and the weight gradient; with ``loss_sequence_tiles`` one tile's, beside
the weight gradient summed over the tiles before).  The peak is at the start of
backward or in a layer's own backward (``layer_backward_peak_bytes``), where the
layers below it keep their sets and the layer's transients join them: in its
MLP's backward one ffn-wide gradient (and, recomputed by selective ``mlp`` or the
MLP's tiles, the rerun's tensors, one tile's), in attention's the core's
gradients or the context-parallel core's score blocks
(``context_parallel_score_bytes``; quadratic in s / cp), and through every
layer's backward the tied output layer's weight gradient, which waits for the
embedding's.  Selective recomputation keeps less (``selective_recompute``):
``core_attn`` not the core's output nor attention dropout's ``s x s`` tensors,
``mlp`` (dense layers) and the MLP's tiles not its ffn-wide tensors (their checkpoints keep the MLP's
input as it comes, the sequence-parallel slice), ``moe`` (MoE layers) not its routed tokens' nor its shared
expert's.  Every checkpoint (selective modules, MLP tiles, a fully recomputed layer, loss tiles) keeps copies of
the generator states it replays (``checkpoint_rng_bytes``: 15 KB on a CPU; a GPU's are host tensors; 16 MLP tiles
a layer were 0.82 of the measured peak without them).
Full recomputation keeps each layer's input and, at most, one layer's set with
its MLP's gradients (with MLP tiles, which a recomputed layer reruns tile by tile, that set's backward as a
layer's without it), or what the start of backward holds; a recomputed MoE layer
peaks in its backward as a kept one, the rerun's transients near its end
(``moe_rerun_elements``) in place of the experts' gradients where larger, beside
the tied output layer's weight gradient.  (Korthikanti et al.
2022's estimate, which this replaced, counts the ``s x s`` attention scores and
the dropout masks that a fused-attention, dropout-free CPU run does not keep:
it read 2x the measured activations at hidden 256.)  With pipeline parallelism each stage counts its own layers (the
output layer and logits on the last stage) times the micro-batches it holds at
once: 1F1B keeps ``min(pp - stage, micro-batches)`` in flight.  On our runtime
(every ``pipeline_schedule`` of ds_megatron's GPT) the rank's own order
(``pipeline_parallel.schedule_table``) is walked: a chunk's activations of a
micro-batch (and its output, sent on but kept for backward) are alive from its
forward to its backward, ZB-H1 keeps each deferred linear's input and output
gradient from B to W (the experts' and the output layer's too), receive buffers posted ahead count until taken, a
backward's input gradient sent back counts until its receiver is known to have taken it (``send_releases``: a
bounded time after the backward; a forward's output sent on is let go by then, before its backward), and the peak
of their sum is planned.

FP8 layers (``model.fp8``, every recipe): each linear keeps fp8 copies of its input and
weight (1 byte an element; blockwise's scales too) instead of its 16-bit input, which is freed where nothing else
keeps it (``fp8_layer_bytes``, exact at TP 1); in fc2's backward a CPU's ``torch._scaled_mm`` makes fp32 copies of
its operands (``fp8_backward_bytes``, the peak on a CPU; not planned on CUDA, whose kernel reads the fp8 bytes).
With ``fp8_param_gather`` the fp8 layers' weights are one byte each (``fp8_weight_elements``).  The delayed
recipe's amax histories and scales live from the build on (``fp8_scaling_state_bytes``,
``RankMemory.fp8_scaling_bytes``).  Under CP each rank's copies are of its ``s / cp`` tokens; ZB-H1's deferred W
keeps the fp8 copies of X and dY (``fp8_deferred_bytes``), and its B peaks in fc2's data-gradient GEMM instead
(``fp8_backward_bytes(deferred=True)``; the W pass's own GEMM copies, made with the chunk's activations gone, are not
planned); MoE experts keep their token groups padded to the
recipe's alignment, counted at the bound (``fp8_expert_bytes``).  MLA's fp8 linears are its five (or four)
projections, the down-projections replicated (``attention_fp8_linears``).

MoE parameters: each rank holds ``num_experts / EP`` experts, their fc1 and fc2
split over ETP (no biases), plus a replicated router and, if configured, a
TP-split shared-expert MLP.

DeepSpeed's optimizer path (``optimizer_impl "deepspeed"``, ``ZeroPlan``) holds what DeepSpeed allocates
(0.19.8, measured tensor by tensor: ``tests/optimizer/test_planning_zero.py``), with ``own`` the parameters
whose partition a rank keeps (``ceil(dense / DP) + ceil(experts / EDP)``) and a reduction bucket of
``zero_optimization.reduce_bucket_size`` elements in the params' dtype (default 5e8: 1 GiB in bf16):

* stage 0: the params, their gradients in the params' dtype, with 16-bit params the fp32 copies of both
  (its 16-bit optimizer without ZeRO) and the optimizer state of every param;
* stage 1: the params and their whole gradients through the accumulation window, the bucket (two with
  ``overlap_comm``) while they are reduced into the partition, fp32 copies of the partition (for fp32 params too),
  its fp32 gradients during the step (one param group's at a time: the dense or the expert partition) and its
  optimizer state;
* stage 2: as stage 1, the gradients reduced into the partition during backward (the bucket alive then: it is
  counted with them), each rank keeping those of every parameter reaching into its partition (up to the
  largest parameter more than ``own``, not counted);
* stage 3: the params' partitions too (parameters under ``stage3_param_persistence_threshold`` elements stay
  whole on every rank: not counted; the gathered params of the layer running are transients, not counted),
  the gradient partitions and one bucket, allocated when the engine is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

from ..config.model import pad_vocab_size
from ..errors import ConfigError
from ..pipeline_parallel.schedule_table import posted_receives, send_releases, sends_of
from .hardware import CPU_KERNELS, DeviceKernels
from .param_counts import gpt_param_counts, pipeline_rank_chunks

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def optimizer_state_bytes_per_param(optimizer_type: str, momentum: float = 0.0) -> int:
    kind = optimizer_type.lower()
    if kind in ("adam", "adamw"):
        return 8
    if kind == "sgd":
        return 4 if momentum else 0
    raise ConfigError(f"optimizer.type={optimizer_type!r} cannot be planned; use Adam, AdamW or SGD")


def selective_recompute(cfg, layer: int, cp: int = 1) -> Tuple[bool, bool]:
    """(core attention, MLP) of layer ``layer`` rerun in backward instead of kept: ``recompute_granularity
    "selective"`` with ``core_attn`` (not under context parallelism: the CP cores are not recomputed) / ``mlp``
    (a dense layer's MLP) or ``moe`` (an MoE layer's, shared expert included), or ``mlp_sequence_tiles`` (each tile
    kept as its input and rerun).  ``layernorm`` saves nothing here: a norm keeps its input, which the
    recomputation keeps too, and its output is the next linear's saved input."""
    modules = set(cfg.recompute_modules or ()) if cfg.recompute_granularity == "selective" else set()
    mlp = ("moe" if cfg.is_moe_layer(layer) else "mlp") in modules
    return "core_attn" in modules and cp == 1, mlp or cfg.mlp_sequence_tiles > 1


def routed_tokens(cfg, tp: int, etp: int) -> float:
    """Tokens an MoE layer's experts on a rank work on, per token of the micro-batch, under balanced routing: each
    TP rank routes its ``1/tp`` of the tokens (its sequence-parallel slice, or the slice the layer scatters without
    sequence parallelism), ``moe_router_topk`` each, and the dispatcher all-gathers them over the ETP group."""
    return cfg.moe_router_topk * etp / tp


def math_attention_bytes(cfg, tp: int, micro_batch: int, s: int, act: int, kernels: DeviceKernels = CPU_KERNELS,
                         inputs_kept: bool = False) -> Tuple[float, float]:
    """``(kept, transient)`` of a layer's core attention beyond ``layer_activation_elements``'s count where the
    device runs attention dropout in torch's math kernel (``DeviceKernels.math_attention_under_dropout``; 0 where it
    runs a fused kernel).  The kernel works in fp32 for 16-bit models (measured with autograd's saved-tensor hooks):
    it keeps three ``[b, heads/tp, s, s]`` tensors (the probabilities, the dropout mask, the dropped probabilities)
    and fp32 copies of the scaled q and of k; v is kept as it is in fp32, as an fp32 copy in 16-bit models, whose
    16-bit q, k and v are then not kept (measured to the byte beside the fused kernel, which keeps q, k, v), unless
    ``inputs_kept`` (recomputed ``core_attn``: its checkpoint keeps them).  Its backward adds one more ``s x s``
    gradient beside the core's dq, dk and dv."""
    if cfg.attention_dropout == 0 or not kernels.math_attention_under_dropout:
        return 0, 0
    wide = max(act, 4)
    scores = micro_batch * (cfg.num_attention_heads // tp) * s * s * wide
    qk, v = cfg.head_widths
    widths = 2 * qk * wide + (v * wide - (0 if inputs_kept else (2 * qk + v) * act) if act < wide else 0)
    return 3 * scores + widths * cfg.num_attention_heads / tp * s * micro_batch, scores


def hidden_dropout_mask_bytes(cfg, tp: int, tokens: int, act: int, kernels: DeviceKernels = CPU_KERNELS) -> float:
    """One hidden-dropout mask of a layer (after attention, after the MLP; split under sequence parallelism): in the
    input's dtype on a CPU (its dropout keeps the scaled mask), a byte an element where the device's is fused."""
    if cfg.hidden_dropout == 0:
        return 0
    sp = cfg.sequence_parallel and tp > 1
    return tokens * cfg.hidden_size / (tp if sp else 1) * (act if kernels.dropout_mask_in_input_dtype else 1)


# The generator states a checkpoint keeps (``tensor_parallel.random.checkpoint``): the default generator's and the
# tracker's two streams' (model-parallel, expert-parallel: ``model_parallel_seed``)
CHECKPOINT_RNG_STATES = 3


def mlp_tiles(cfg, rows: int) -> int:
    """The tiles a rank's MLP input of ``rows`` rows runs in: ``mlp_sequence_tiles``, at most one per row."""
    return min(max(1, cfg.mlp_sequence_tiles), rows)


def checkpoint_rng_bytes(cfg, layer: int, tp: int = 1, cp: int = 1, kernels: DeviceKernels = CPU_KERNELS) -> int:
    """The generator states kept by layer ``layer``'s checkpoints inside it until their backward
    (``CHECKPOINT_RNG_STATES`` per checkpoint, ``DeviceKernels.rng_state_bytes`` each): one for the core
    (``core_attn``), the MLP (``mlp`` / ``moe``; one per tile with ``mlp_sequence_tiles``, at most one per row of the
    rank's sequence), and each norm (``layernorm``: two, four with post_sublayer_norms).  A fully recomputed
    layer's own checkpoint: ``activation_bytes``."""
    core, mlp = selective_recompute(cfg, layer, cp)
    layernorm = cfg.recompute_granularity == "selective" and "layernorm" in (cfg.recompute_modules or ())
    rows = cfg.seq_length // cp // (tp if cfg.sequence_parallel and tp > 1 else 1)
    mlp_checkpoints = mlp_tiles(cfg, rows) if cfg.mlp_sequence_tiles > 1 else int(mlp)
    norms = (4 if cfg.post_sublayer_norms else 2) if layernorm else 0
    return (int(core) + mlp_checkpoints + norms) * CHECKPOINT_RNG_STATES * kernels.rng_state_bytes


def layer_activation_elements(cfg, layer: int, tp: int, etp: int = 1, cp: int = 1,
                              micro_batch: Optional[int] = None, kernels: DeviceKernels = CPU_KERNELS) -> float:
    """What one transformer layer keeps for backward, in elements per token of the micro-batch (see the
    module docstring), by the layer's own widths: the two norms' inputs (four with post_sublayer_norms);
    attention's input (gathered under sequence parallelism) and, per head on this rank, q, k and v (GQA's k and
    v repeated to every head), the core's output and its re-layout (the soft-capped core: its s x s scores and
    probabilities too), or MLA's latents, its q, k, v and output (``qk_head_dim +
    qk_pos_emb_head_dim`` wide: v padded to it) and the re-layout (``v_head_dim``); the attention sinks' core: its
    ``s x (s + 1)`` probabilities too; the MLP's input and its ``ffn``-wide tensors (GELU: fc1's output and the
    activation's; gated: fc1's two halves, act(gate) and the product; gpt-oss's clamped quick-GELU GLU three
    more); an MoE layer's router input (``mlp_input_elements``) and, per routed token (``routed_tokens``: the
    ETP-gathered ``moe_router_topk`` per token under balanced routing), the permuted input, the experts' ffn-wide
    tensors (one more: the routing weight's product) and the output before the combining sum, plus a shared expert
    as a dense MLP.  At micro-batch 1 (no CP, a fused core: on a CPU no attention dropout) the re-layout is a view
    of the core's output (the fused kernels write it [b, s, heads, d]), so they count once.  Selective
    recomputation (``selective_recompute``): the core's output is not kept (``core_attn``: its inputs q, k, v
    are, and the re-layout), nor the MLP's ffn-wide tensors, experts and shared expert (``mlp`` or the MLP's
    tiles: its input is).  ``kernels``: the device's (``planning.hardware.DeviceKernels``)."""
    core, mlp = selective_recompute(cfg, layer, cp)
    h = cfg.hidden_size
    sp = cfg.sequence_parallel and tp > 1
    norms = (4 if cfg.post_sublayer_norms else 2) * (h / tp if sp else h)  # Gemma: the sublayers' outputs too
    if cfg.multi_latent_attention:
        q_latent = 2 * cfg.q_lora_rank if cfg.q_lora_rank else 0
        qk, v = cfg.head_widths
        # q, k and (padded to their width where it differs, see MLASelfAttention._core) v and the output;
        # the re-layout of the output's v channels
        attention = h + q_latent + 2 * cfg.kv_lora_rank + cfg.num_attention_heads / tp * ((3 if core else 4) * qk + v)
    else:
        fused = cfg.attention_dropout == 0 or not kernels.math_attention_under_dropout
        shared = micro_batch == 1 and cp == 1 and fused  # re-layout: a view of the output
        attention = h + (4 if core or shared else 5) * cfg.num_attention_heads * cfg.head_dim / tp
        if cfg.attn_logit_softcapping is not None and not core:
            # the soft-capped core is not fused: its capped scores and probabilities, [b, heads/tp, s, s] each
            attention += 2 * cfg.num_attention_heads / tp * cfg.seq_length
        elif cfg.softmax_type == "learnable" and not core and cp == 1:
            # the sinks' core (the CP cores keep their rows' log-sum-exp only) is not fused: its probabilities with the sink's column, [b, heads/tp, s, s + 1]
            attention += cfg.num_attention_heads / tp * (cfg.seq_length + 1)
    mlp_tensors = 0 if mlp else mlp_activation_elements(cfg, layer, tp, etp)
    return norms + attention + mlp_input_elements(cfg, layer, tp) + mlp_tensors


def mlp_input_elements(cfg, layer: int, tp: int) -> float:
    """The MLP's kept input per token: a dense MLP's fc1 keeps it gathered under sequence parallelism, an MoE
    layer's router its own sequence-parallel slice (measured; a shared expert keeps its gathered copy, counted in
    ``mlp_activation_elements``), as does the checkpoint of a recomputed MLP or its tiles (fc1 gathers in it)."""
    sp = cfg.sequence_parallel and tp > 1
    _, recomputed = selective_recompute(cfg, layer)
    return cfg.hidden_size / tp if sp and (cfg.is_moe_layer(layer) or recomputed) else cfg.hidden_size


def attention_fp8_linears(cfg, tp: int, cp_copy: bool = False) -> List[Tuple[float, float, bool, bool]]:
    """An fp8 layer's attention linears as (input features per rank, output features per rank, 16-bit input freed,
    split over TP): QKV and the projection; under MLA the down-projections (replicated: whole on every rank; both
    read the layer's input, freed once), the up-projections (their inputs, the latent norms' outputs, freed) and
    ``o_proj`` (its input freed).  The split ones' weight gradients are deferrable by ZB-H1 and their weights gathered in fp8 by
    ``fp8_param_gather``; a replicated one's are neither.  The projection's input is freed only where a
    context-parallel core made it as a copy (``cp_copy``, see ``fp8_layer_bytes``)."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    if not cfg.multi_latent_attention:
        qkv = (a + 2 * cfg.query_groups) * cfg.head_dim
        return [(h, qkv / tp, True, True), (a * cfg.head_dim / tp, h, cp_copy, True)]
    qk, v = cfg.head_widths
    kv_a = (h, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, False, False)
    if cfg.q_lora_rank:
        q = [(h, cfg.q_lora_rank, True, False), kv_a, (cfg.q_lora_rank, a * qk / tp, True, True)]
    else:
        q = [(h, a * qk / tp, True, True), kv_a]
    # o_proj's input is the core's output cut to v_head_dim and re-laid out: a copy only it keeps (measured)
    return q + [(cfg.kv_lora_rank, a * (cfg.qk_head_dim + v) / tp, True, True), (a * v / tp, h, True, True)]


def fp8_layer_bytes(cfg, layer: int, tp: int, tokens: int, act: int, cp: int = 1, etp: int = 1,
                    ep: int = 1) -> float:
    """What an fp8 layer keeps beyond ``layer_activation_elements``'s 16-bit count, for ``tokens`` tokens: each
    fp8 linear keeps fp8 copies of its input and weight (1 byte an element) instead of its 16-bit input, which
    is then freed where nothing else keeps it (QKV's and fc1's inputs, the norms' outputs, gathered under
    sequence parallelism; fc2's input, the activation's output; the projection's, the core's output, only where
    a context-parallel core made it as a 16-bit copy: measured).  Tensorwise keeps a scalar scale per copy;
    blockwise tiles the input along the tokens (an fp32 scale per 128) and the weight by 128x128 blocks.  An MoE
    layer's experts: ``fp8_expert_bytes``, its shared expert as a dense MLP's linears.  MLP recomputed (selective
    ``mlp``, its tiles): its linears keep nothing."""
    if not cfg.fp8_layer(layer):
        return 0
    _, mlp = selective_recompute(cfg, layer, cp)
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    glu = 2 if cfg.gated_linear_unit else 1
    # (input features per rank, output features per rank, 16-bit input freed).  The projection's input, the core's
    # output, is kept by a fused core; under CP it is a new tensor, which fp8 frees: the ring's and all-gather's
    # cores keep their fp32 output and hand on a 16-bit copy (the same tensor in fp32), Ulysses's all-to-all
    # makes one (measured for bf16, every cp_comm_type).
    cp_copy = cp > 1 and (act < 4 or cfg.cp_comm_type in ("a2a", "a2a+p2p"))
    linears = [(k, n, freed) for k, n, freed, _ in attention_fp8_linears(cfg, tp, cp_copy)]
    moe = cfg.is_moe_layer(layer)
    sp = cfg.sequence_parallel and tp > 1
    if not mlp and not moe:
        linears += [(h, glu * ffn / tp, True), (ffn / tp, h, True)]
    elif not mlp and cfg.moe_shared_expert_intermediate_size:
        # the shared expert's fc1 takes the norm's output, which the router keeps (measured), unless gathered (SP)
        shared = cfg.moe_shared_expert_intermediate_size
        linears += [(h, glu * shared / tp, sp), (shared / tp, h, True)]
    blockwise = cfg.fp8_recipe == "blockwise"
    total = fp8_expert_bytes(cfg, tp, etp, ep, tokens) if moe and not mlp else 0.0
    for k, n, freed in linears:
        x = tokens * k * (1 + 4 / 128 if blockwise else 1)
        w = n * k + (4 * -(-n // 128) * -(-k // 128) if blockwise else 0)  # MLA's kv_a: a partial block row
        total += x + w - (tokens * k * act if freed else 0) + (0 if blockwise else 8)
    return total


def fp8_expert_bytes(cfg, tp: int, etp: int, ep: int, tokens: int) -> float:
    """What an MoE layer's fp8 experts keep for ``tokens`` tokens of the rank (``fp8.grouped``): per local expert
    and projection the fp8 copies of its token group, padded with zero rows to the recipe's alignment (16;
    blockwise 128, tiled 1x128 along the tokens with an fp32 scale per 128), and of its weight (blockwise: a scale
    per 128x128 block; tensorwise two scalar scales), and per projection the int64 row index of the padded rows
    (kept by the padding's autograd).  Nothing 16-bit is freed: the experts' inputs are kept by the layer's other
    ops (measured).  The padding depends on the routing, which the plan does not know: it counts the bound, every
    local expert padded by alignment - 1 rows and the indices kept (``tests/fp8/test_fp8_plan.py`` holds a
    measured layer between this bound and the count without padding); the routed tokens are the balanced
    ``routed_tokens``, as ``layer_activation_elements`` counts them."""
    h, ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size / etp
    glu = 2 if cfg.gated_linear_unit else 1
    local = cfg.num_experts // ep
    routed = tokens * routed_tokens(cfg, tp, etp)
    blockwise = cfg.fp8_recipe == "blockwise"
    align = 128 if blockwise else 16
    rows = routed + local * (align - 1)
    total = 0.0
    for k, n in ((h, glu * ffn), (ffn, h)):
        total += rows * k * (1 + 4 / 128 if blockwise else 1) + local * n * k * (1 + 4 / 128 ** 2 if blockwise else 1)
        total += (0 if blockwise else 8 * local) + 8 * routed
    return total


def fp8_backward_bytes(cfg, layer: int, tp: int, tokens: int, act: int, cp: int = 1, etp: int = 1,
                       ep: int = 1, kernels: DeviceKernels = CPU_KERNELS, deferred: bool = False) -> float:
    """What an fp8 layer's MLP backward holds beyond the 16-bit count, at its peak in fc2's backward: the output
    gradient's fp8 copy and, in the weight-gradient GEMM (beside the input gradient), its 16-bit output and, on a
    CPU (``DeviceKernels.fp8_gemm_fp32_copies``), torch._scaled_mm's two fp32 copies of each operand ([T, h] and
    [T, ffn/tp]) and its fp32 output (measured; a GPU's kernel reads the fp8 bytes).  A recomputed MLP (selective
    ``mlp``, its tiles: one tile's tokens at a time) reruns its forward in its backward, where fc1's and fc2's
    fp8 copies of their inputs and weights take the place of the 16-bit inputs the 16-bit count holds.  An MoE
    layer's: one expert's fc2 at a time, its token group under balanced routing padded to the alignment.
    ``deferred`` (ZB-H1's B, which runs the data gradient only; W makes the weight gradients later): its peak in
    fc2's data-gradient GEMM instead, the output gradient's fp8 copy and, on a CPU, the GEMM's two fp32 copies of
    each operand ([T, h] and the weight [h, ffn/tp]) and its fp32 output [T, ffn/tp] (its 16-bit output is the
    input gradient the 16-bit count holds)."""
    if not cfg.fp8_layer(layer):
        return 0
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size / tp
    _, mlp = selective_recompute(cfg, layer, cp)
    if cfg.is_moe_layer(layer):
        ffn, local = cfg.moe_ffn_hidden_size / etp, cfg.num_experts // ep
        routed = tokens * routed_tokens(cfg, tp, etp)
        tokens = -(-routed // local) + (127 if cfg.fp8_recipe == "blockwise" else 15)
    tokens = -(-tokens // max(1, cfg.mlp_sequence_tiles))
    glu = 2 if cfg.gated_linear_unit else 1
    rerun = h * (glu + 1) * ffn - (act - 1) * tokens * (h + ffn) if mlp else 0
    if deferred:
        return rerun + h * tokens + ((8 * h + 4 * ffn) * tokens + 8 * h * ffn if kernels.fp8_gemm_fp32_copies else 0)
    if not kernels.fp8_gemm_fp32_copies:
        return rerun + h * tokens + act * h * ffn
    return rerun + (h + 8 * (h + ffn)) * tokens + (4 + act) * h * ffn


def mlp_activation_elements(cfg, layer: int, tp: int, etp: int = 1) -> float:
    """The MLP's part of ``layer_activation_elements`` beyond its input, per token: a dense MLP's ffn-wide
    tensors, or an MoE layer's router input, routed tokens' expert tensors and shared expert."""
    h = cfg.hidden_size
    sp = cfg.sequence_parallel and tp > 1
    ffn_tensors = 4 if cfg.gated_linear_unit else 2
    if cfg.gated_linear_unit:  # measured: quick_gelu keeps its sigmoid; the clamps and offset their new gate / up
        clamp = cfg.activation_func_clamp_value is not None
        ffn_tensors += int(cfg.activation == "quick_gelu") + int(clamp) + int(clamp or bool(cfg.glu_linear_offset))
    if not cfg.is_moe_layer(layer):
        return ffn_tensors * cfg.ffn_hidden_size / tp
    routed = routed_tokens(cfg, tp, etp)
    # the routed rows' input, their ffn-wide tensors and the rows un-permuting's scatter-add keeps: back from the
    # ETP reduce-scatter, this rank's k / tp per token (measured: 0.97 of the plan at TP 2 + SP x ETP 2 counted
    # as the ETP-gathered rows)
    experts = routed * (h + (ffn_tensors + 1) * cfg.moe_ffn_hidden_size / etp) + cfg.moe_router_topk / tp * h
    shared = cfg.moe_shared_expert_intermediate_size
    # under sequence parallelism the shared expert keeps its gathered input (else the router's, counted already)
    shared_expert = (h if sp else 0) + ffn_tensors * shared / tp if shared else 0
    return experts + shared_expert


def moe_rerun_elements(cfg, tp: int, etp: int, ep: int, kernels: DeviceKernels = CPU_KERNELS) -> float:
    """What an MoE layer's forward holds near its end beyond the tensors it keeps, per token of the micro-batch
    (``moe_layer``, ``token_dispatcher``, ``experts``), where a recomputed layer's rerun peaks, its gradient
    waiting (under balanced routing, ``routed_tokens`` rows per token; the rows back from ETP / EP that
    un-permuting keeps, this rank's ``k / tp`` per token, not made until its end): through the experts, with
    several local experts, the dispatched rows before their sort by expert (the layer holds them to its end), and
    the larger of
    * the experts' outputs and their concatenation;
    * over ETP, the reduce-scatter's rows received from every peer and their sum, beside the rows sent;
    * un-permuting, where the rerun stops (torch's checkpoint stops at the last tensor saved: the scatter-add's
      inputs, saved before it adds): the combined rows the layer still holds (a copy beside the rows back over
      ETP / EP) and the scatter-add's zeros (``1 / tp`` per token);
    with a shared expert, its output beside them (split under sequence parallelism); grouped experts on a device
    that pads their groups (``DeviceKernels.padded_grouped_gemm``) their fc1's padded input throughout, beside the
    rows it copies (balanced routing: no padding).  Measured at EP 2 (all-to-all): 1.08 of the peak with the rows
    back counted again and the scatter-add's sum, which the stopped rerun never makes."""
    h, k = cfg.hidden_size, cfg.moe_router_topk
    routed = routed_tokens(cfg, tp, etp)
    back = k / tp * h
    unsorted = routed * h if cfg.num_experts // ep > 1 else 0
    concat = 2 * routed * h - back
    scatter = 2 * routed * h if etp > 1 else 0
    unpermute = (routed * h if ep * etp > 1 else 0) + h / tp
    sp = cfg.sequence_parallel and tp > 1
    shared = (h / tp if sp else h) if cfg.moe_shared_expert_intermediate_size else 0
    padded = routed * h if cfg.moe_grouped_gemm and kernels.padded_grouped_gemm else 0
    return unsorted + max(concat, scatter, unpermute) + shared + padded


def layer_backward_peak_bytes(cfg, layer: int, tp: int, micro_batch: int, params_dtype: str, cp: int, etp: int,
                              kept: float, scores: int, ep: int = 1, kernels: DeviceKernels = CPU_KERNELS,
                              recomputed: bool = False, deferred: bool = False) -> float:
    """The height of layer ``layer``'s own backward beyond the layers below it, which keep their sets: its kept
    set ``kept`` and the gradient flowing down the residual stream (one [s, b, h], two in attention's backward),
    then the larger of
    * the MLP's backward: one of its two ffn-wide gradients (the first is freed before the second is made);
      recomputed (selective ``mlp``, the MLP's tiles), the rerun's tensors too, one tile's at a time, beside the
      tiles' input gradient; an MoE layer rerun (selective ``moe``, or the whole layer: ``recomputed``, its kept
      set ``kept`` made again) its tensors and the larger of the rerun's transients (``moe_rerun_elements``) and
      the experts' gradients;
    * attention's backward, the MLP's share freed by then (its tensors, its input and the norm's): the core's
      transients, the CP core's score blocks ``scores`` or the core's dq, dk and dv, and the math kernel's
      ``s x s`` gradient (``math_attention_bytes``; recomputed ``core_attn``: its output again, and what the math
      kernel keeps).  ``kernels``: the device's (``planning.hardware.DeviceKernels``); ``deferred``: ZB-H1's B
      (``fp8_backward_bytes``)."""
    s, b, h, a = cfg.seq_length // cp, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    act = BYTES[params_dtype]
    sp = cfg.sequence_parallel and tp > 1
    core, mlp = selective_recompute(cfg, layer, cp)
    token = s * b * act
    glu = 2 if cfg.gated_linear_unit else 1
    if cfg.is_moe_layer(layer):
        routed = routed_tokens(cfg, tp, etp)
        grads = 2 * glu * (routed * cfg.moe_ffn_hidden_size / etp + (cfg.moe_shared_expert_intermediate_size or 0) / tp)
    else:
        grads = 2 * glu * cfg.ffn_hidden_size / tp
    # under sequence parallelism also the column-parallel layer's whole input gradient before its reduce-scatter
    stream = h / tp + h if sp else h
    mlp_tensors = mlp_activation_elements(cfg, layer, tp, etp)
    # Measured: the MLP's backward peaks with its tensors and half its gradients (GELU: fc1's output, the
    # activation and the activation's gradient; the activation is freed before fc1's output gradient is made).
    if cfg.is_moe_layer(layer) and (mlp or recomputed):
        rerun = (mlp_tensors if mlp else 0) + max(moe_rerun_elements(cfg, tp, etp, ep, kernels), grads / 2)
    elif mlp:
        tiles = max(1, cfg.mlp_sequence_tiles)
        # under sequence parallelism the rerun gathers its input again: the gathered input and the collective's
        # staging copy (gloo; measured on 2 ranks at the lowest of six passes, which a third buffer, gloo's
        # threads freeing late, only sometimes joins)
        rerun = (mlp_tensors + (2 * h if sp else 0) + grads / 2) / tiles + (h if tiles > 1 else 0)
    else:
        rerun = grads / 2
    mask = hidden_dropout_mask_bytes(cfg, tp, s * b, act, kernels)  # the MLP's freed first, then the attention's
    mlp_phase = kept - mask + (stream + rerun) * token
    mlp_phase += fp8_backward_bytes(cfg, layer, tp, s * b, act, cp, etp, ep, kernels, deferred)
    freed = (0 if mlp else mlp_tensors) + mlp_input_elements(cfg, layer, tp) + (h / tp if sp else h)
    qk, v = cfg.head_widths
    if cp > 1:
        core_transient = scores
    else:
        core_transient = (3 * qk if not cfg.multi_latent_attention else 2 * qk + v) * a / tp * token
        math_kept, math_transient = math_attention_bytes(cfg, tp, b, s, act, kernels, inputs_kept=core)
        core_transient += math_transient
        if core:
            core_transient += v * a / tp * token + math_kept
    attention_phase = kept - 2 * mask + (stream + (h / tp if sp else h) - freed) * token + core_transient
    return max(mlp_phase, attention_phase)


def context_parallel_score_bytes(cfg, tp: int, micro_batch: int, params_dtype: str, cp: int,
                                 hierarchical_inner: Optional[int] = None) -> int:
    """The context-parallel core's transient scores at their peak: three score blocks alive at once (the scores,
    the probabilities and, in backward, their gradient), in the scores' dtype (fp32 for 16-bit models).  A block
    is ``[b, heads/tp, rows, keys]``: the ring's a zigzag chunk against one (``s/2cp`` by ``s/2cp``), the
    all-gather's this rank's queries against the whole sequence (``s/cp`` by ``s``), Ulysses's one zigzag chunk
    of its ``heads/cp`` heads against the whole sequence, the hierarchical ring's a quarter of its members' rows
    against a member's keys.  Beside them in backward: dq's accumulator and a block's partial products (two
    [s/cp] query-wide tensors; Ulysses's core seven: its whole dk and dv, a tile's partials and mask too) and, for
    the rings (``p2p``, ``a2a+p2p``), K/V-sized buffers: the K/V held and the next arriving (in the model's dtype),
    the own block's dK/dV, the held block's and, on rings of three or more, the accumulator arriving (fp32 for
    16-bit models); the hierarchical ring's blocks are masked by position, a bool per score.  Measured within 10%
    for each (``tests/optimizer/test_planning.py``) and at the long-sequence bench's widths."""
    if cp <= 1:
        return 0
    s, b = cfg.seq_length, micro_batch
    heads = cfg.num_attention_heads // tp
    kind = cfg.cp_comm_type
    if kind == "all_gather":
        block = heads * (s // cp) * s
    elif kind == "a2a":
        block = heads // cp * (s // (2 * cp)) * s
    elif kind == "a2a+p2p":
        inner = hierarchical_inner or cp
        rows = inner * s // cp
        block = heads // inner * -(-rows // 4) * rows
    else:
        block = heads * (s // (2 * cp)) ** 2
    scores = 3 * b * block * max(BYTES[params_dtype], 4)
    if kind == "a2a+p2p":  # its blocks are masked by the tokens' positions: a bool per score (measured)
        scores += b * block
    # 16-bit models: the core works on fp32 copies: q, k, dq, dk at the query/key width, v, the output, its
    # gradient and dv at the value width (MLA's are its own; standard attention's both head_dim).
    qk, v = cfg.head_widths
    copies = 4 * (qk + v) * b * heads * (s // cp) * 4 if BYTES[params_dtype] < 4 else 0
    ring = 0
    if kind in ("p2p", "a2a+p2p"):
        kv_heads = kv_heads_per_rank(cfg, tp)
        if kind == "a2a+p2p" and kv_heads % (hierarchical_inner or cp):
            kv_heads = heads  # too few KV heads for the a2a: each query head gets its own copy
        pair = b * kv_heads * (s // cp) * (qk + v)  # this rank's share of K and V, as it travels
        hops = cp // (hierarchical_inner or cp) if kind == "a2a+p2p" else cp
        # the K/V held and the next arriving (model dtype); dK/dV of the own block, of the held one and, on rings
        # of three or more, the accumulator arriving (fp32 for 16-bit models)
        ring = pair * (2 * BYTES[params_dtype] + (3 if hops > 2 else 2) * max(BYTES[params_dtype], 4))
    # dq's accumulator and a block's partial products, at the query width; Ulysses's core also holds its whole
    # dk and dv, a tile's dk / dv partials and the tile's mask beside them (measured).  The 16-bit cores' dq (and
    # Ulysses's dk, dv) are among the fp32 copies above.
    units = {"a2a": 7, "a2a+p2p": 4}.get(kind, 2) - ((3 if kind == "a2a" else 1) if copies else 0)
    grads = units * b * heads * (s // cp) * qk * max(BYTES[params_dtype], 4)
    return scores + copies + ring + grads


def context_parallel_saved_bytes(cfg, tp: int, micro_batch: int, params_dtype: str, cp: int) -> int:
    """What the all-gather core keeps per layer beyond this rank's K/V: the gathered K and V of the whole
    sequence (in the scores' dtype) for backward."""
    if cp <= 1 or cfg.cp_comm_type != "all_gather":
        return 0
    width = sum(cfg.head_widths)
    return micro_batch * kv_heads_per_rank(cfg, tp) * cfg.seq_length * width * max(BYTES[params_dtype], 4)


def kv_heads_per_rank(cfg, tp: int) -> int:
    """K/V heads on a TP rank: one group's copy when TP exceeds the groups; MLA's every head has its own."""
    if cfg.multi_latent_attention:
        return cfg.num_attention_heads // tp
    return max(cfg.query_groups // tp, 1)


def check_recompute_planned(cfg) -> None:
    """Refuse what the activation plan does not model: recomputed MoE layers (full recomputation, selective
    ``moe``) with the all-gather dispatcher or fp8 experts, whose reruns hold other transients than the
    all-to-all dispatcher's 16-bit experts counted (``moe_rerun_elements``; planned they read 1.10-1.14 of the
    measured peak)."""
    selective = cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or ())
    if not cfg.num_experts or not (cfg.recompute_granularity == "full" or selective):
        return
    if cfg.moe_token_dispatcher_type == "allgather":
        raise ConfigError("model.moe_token_dispatcher_type='allgather' with recomputed MoE layers: the activation "
                          "plan does not model that dispatcher's rerun; plan it with 'alltoall' or without "
                          "recomputing the MoE layers")
    if cfg.fp8:
        raise ConfigError(f"model.fp8={cfg.fp8!r} with recomputed MoE layers: the activation plan does not model "
                          "fp8 experts' rerun; plan it without fp8 or without recomputing the MoE layers")


def activation_bytes(cfg, tp: int, micro_batch: int, params_dtype: str, num_layers: Optional[int] = None,
                     logits: bool = True, cp: int = 1, layers: Optional[Sequence[int]] = None, etp: int = 1,
                     hierarchical_inner: Optional[int] = None, embedding: bool = True, kept_only: bool = False,
                     ep: int = 1, kernels: DeviceKernels = CPU_KERNELS, deferred: bool = False) -> int:
    """Activation memory of one micro-batch at its peak, the start of backward (see the module docstring).

    ``num_layers`` / ``logits``: a pipeline stage's share (its layers; final norm, output layer and
    logits on the last stage only); ``layers``: their indices in the model, where layers differ (dense and
    MoE).  ``cp``: each context-parallel rank holds ``seq_length / cp`` tokens (Megatron's formula with
    s -> s/cp; attention dropout, whose s x s term would not split, is refused with cp > 1).  ``embedding``: the
    chunk also holds the word embedding (the tied output layer's weight gradient then waits for the embedding's
    through the layers' backward).  ``kept_only``: what a micro-batch keeps from its forward to its backward,
    without the transients of its backward (a pipeline counts those once, not per micro-batch in flight).
    ``kernels``: the habits of the device planned for (``planning.hardware.DeviceKernels``; a CPU's by default).
    ``deferred``: backward as ZB-H1's B runs it, the weight gradients deferred (``fp8_backward_bytes``)."""
    check_recompute_planned(cfg)
    s, b, h = cfg.seq_length // cp, micro_batch, cfg.hidden_size
    if layers is None:
        layers = range(cfg.num_layers if num_layers is None else num_layers)
    L = len(layers)
    act = BYTES[params_dtype]
    sbh = s * b * h
    sp = cfg.sequence_parallel and tp > 1
    extra = 0
    if not selective_recompute(cfg, 0, cp)[0]:  # core_attn: every layer alike
        extra += math_attention_bytes(cfg, tp, b, s, act, kernels)[0]
    extra += 2 * hidden_dropout_mask_bytes(cfg, tp, s * b, act, kernels)  # the attention's and the MLP's
    extra += context_parallel_saved_bytes(cfg, tp, micro_batch, params_dtype, cp)
    per_layer = [layer_activation_elements(cfg, i, tp, etp, cp, b, kernels) * s * b * act + extra
                 + fp8_layer_bytes(cfg, i, tp, s * b, act, cp, etp, ep) + checkpoint_rng_bytes(cfg, i, tp, cp, kernels)
                 for i in layers]
    backward_start = weight_grad = 0
    if logits:
        vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        head = sbh * ((1 / tp + 1) if sp else 2) * act  # final LayerNorm input, output layer input
        # loss_sequence_tiles: one tile's logits at a time (each tile's made again in its backward).
        tile_rows = -(-s // max(1, min(cfg.loss_sequence_tiles, s)))
        tiled = tile_rows < s
        one_head = tile_rows * b * (vocab // tp)  # elements of one head's (one tile's) logits
        saved_logits = one_head * (act + (4 if act < 4 else 0))  # what the loss keeps: 16-bit logits' fp32 copy too
        weight_grad = (vocab // tp) * h * act
        # The head's backward in two phases, the larger planned: the loss's (its logits; tiled, beside the weight
        # gradient summed over the tiles before) and the output layer's (the logits' gradient and the new weight
        # gradient, tiled beside that sum and, from the third tile, the new sum, made before the two are freed; the
        # input's gradient, [tile rows, h], gathered under SP, made before the weight's: 0.96 of the peak of TP 2 + SP
        # with MoE layers without it).  Measured: fp32 peaks in the second, 16-bit in the first.
        loss_phase = saved_logits + (weight_grad if tiled else 0)
        weight_phase = (one_head + tile_rows * b * h) * act + weight_grad * (
            1 if not tiled else 2 if cfg.loss_sequence_tiles == 2 else 3)
        # Multi-token prediction (on the last stage): per depth its two input norms, eh_proj's input [2h]
        # (gathered), its transformer layer, final norm and head input, and (untiled) its head's logits.
        depths = cfg.mtp_num_layers or 0
        norm = h / tp if sp else h
        mtp = sum((3 * norm + 3 * h + layer_activation_elements(cfg, cfg.num_layers + k, tp, etp, cp, b, kernels))
                  * s * b * act
                  + extra + fp8_layer_bytes(cfg, cfg.num_layers + k, tp, s * b, act, cp, etp, ep)
                  + checkpoint_rng_bytes(cfg, cfg.num_layers + k, tp, cp, kernels) for k in range(depths))
        other_heads = 0 if tiled else depths * one_head * 4  # the loss keeps fp32 logits (16-bit ones freed)
        loss_checkpoints = cfg.loss_sequence_tiles * kernels.rng_state_bytes if tiled else 0  # the default generator's
        backward_start = head + mtp + other_heads + max(loss_phase, weight_phase) + loss_checkpoints
    # Context parallelism: the core's score blocks, made in a layer's attention (the head's tensors gone by then
    # in backward), planned beside every layer's activations.
    scores = context_parallel_score_bytes(cfg, tp, micro_batch, params_dtype, cp, hierarchical_inner)
    tied = weight_grad if logits and embedding and not cfg.untie_embeddings_and_output_weights else 0
    if cfg.recompute_granularity != "full":
        if kept_only:
            return int(sum(per_layer))
        layer_peak = max(below + layer_backward_peak_bytes(cfg, i, tp, b, params_dtype, cp, etp, per_layer[k], scores,
                                                           ep, kernels, deferred=deferred)
                         for k, (i, below) in enumerate(zip(layers, accumulate(per_layer, initial=0))))
        return int(max(sum(per_layer) + backward_start, layer_peak + tied))
    # Recomputation: the recomputed layers' inputs and checkpoints (their own and those nested in them, made in the
    # forward; recompute_method "block": the first recompute_num_layers of the stage or chunk), then the larger of what the start of backward holds (with the
    # later, not recomputed layers' activations) and one recomputed layer's set with its MLP's two ffn-wide
    # gradients (by then the later layers' backward is done); with MLP tiles, the set's backward as a layer's
    # without full recomputation (one tile's rerun at a time), beside the tied output layer's weight gradient.
    recomputed = [j for j in range(L) if cfg.recomputes_layer(j)]
    nested = {j: checkpoint_rng_bytes(cfg, layers[j], tp, cp, kernels) for j in recomputed}
    inputs = sum(sbh / (tp if sp else 1) * act + CHECKPOINT_RNG_STATES * kernels.rng_state_bytes + nested[j]
                 for j in recomputed)
    ffn = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    dense = [j for j in recomputed if not cfg.is_moe_layer(layers[j])]
    if not dense:
        one_layer = 0
    elif cfg.mlp_sequence_tiles > 1:
        one_layer = max(layer_backward_peak_bytes(cfg, layers[j], tp, b, params_dtype, cp, etp,
                                                  per_layer[j] - nested[j], 0, ep, kernels, deferred=deferred)
                        for j in dense) + tied
    else:
        one_layer = max(per_layer[j] + fp8_backward_bytes(cfg, layers[j], tp, s * b, act, cp, etp, ep, kernels,
                                                          deferred) for j in dense) + 2 * ffn / tp * s * b * act
    kept = sum(n for j, n in enumerate(per_layer) if j not in recomputed)
    if kept_only:
        return int(inputs + kept)
    # An MoE layer's backward as a kept one's (the rerun made its set again, the later layers' backward done),
    # the tied output layer's weight gradient waiting beside it.
    moe_peak = max((layer_backward_peak_bytes(cfg, layers[j], tp, b, params_dtype, cp, etp, per_layer[j], scores, ep,
                                              kernels, recomputed=True, deferred=deferred) + tied
                    for j in recomputed if j not in dense), default=0)
    return int(inputs + max(backward_start + kept, one_layer + scores, kept + scores, moe_peak))


def deferred_weight_grad_bytes(cfg, tp: int, micro_batch: int, params_dtype: str, layers: Sequence[int],
                               cp: int = 1, logits: bool = False, etp: int = 1, ep: int = 1) -> int:
    """What ZB-H1 keeps of one micro-batch of a chunk between its B and its W: each deferred linear's input and
    output gradient: QKV and the attention output; a dense MLP's fc1 and fc2; an MoE layer's experts (for the
    tokens routed to this rank under balanced routing, ``routed_tokens``) and
    shared expert; with ``logits`` the tied or untied output layer's input [s, b, h] and the logits' gradient
    [s, b, V/tp] (not under ``loss_sequence_tiles``, which defers no output layer)."""
    s, b, h = cfg.seq_length // cp, micro_batch, cfg.hidden_size
    d = cfg.head_dim
    glu = 2 if cfg.gated_linear_unit else 1
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
    per_layer_attention = (h + qkv / tp + cfg.num_attention_heads * d / tp + h) * s * b

    def mlp(ffn, tokens, split):  # fc1: input, output gradient; fc2: input, output gradient
        return (h + glu * ffn / split + ffn / split + h) * tokens
    dense = mlp(cfg.ffn_hidden_size, s * b, tp)
    moe = 0
    if cfg.num_experts:
        moe = mlp(cfg.moe_ffn_hidden_size, s * b * routed_tokens(cfg, tp, etp), etp)
        if cfg.moe_shared_expert_intermediate_size:
            moe += mlp(cfg.moe_shared_expert_intermediate_size, s * b, tp)
    total = sum(per_layer_attention + (moe if cfg.is_moe_layer(i) else dense) for i in layers)
    if logits and cfg.loss_sequence_tiles <= 1:
        vocab = pad_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
        total += (h + vocab // tp) * s * b
    act = BYTES[params_dtype]
    return int(total * act + sum(fp8_deferred_bytes(cfg, i, tp, s * b, act, etp, ep) for i in layers))


def fp8_deferred_bytes(cfg, layer: int, tp: int, tokens: int, act: int, etp: int = 1, ep: int = 1) -> float:
    """What an fp8 layer's deferred weight gradients keep from B to W beyond ``deferred_weight_grad_bytes``'s 16-bit
    count, for ``tokens`` tokens: each fp8 linear's W runs on the fp8 copies of X and dY its B pass made (1 byte an
    element, not ``act``; tensorwise and delayed a scalar scale each, blockwise both tiled 1x128 along the tokens
    with an fp32 scale per 128); the 16-bit X and dY are not kept.  An MoE layer's experts: each local expert's
    token group padded to the alignment, counted at the bound as in ``fp8_expert_bytes``."""
    if not cfg.fp8_layer(layer):
        return 0
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    glu = 2 if cfg.gated_linear_unit else 1
    blockwise = cfg.fp8_recipe == "blockwise"
    elem = 1 + 4 / 128 if blockwise else 1
    linears = [(k, n) for k, n, _, split in attention_fp8_linears(cfg, tp) if split]  # (in, out) per rank
    experts = 0.0
    if not cfg.is_moe_layer(layer):
        linears += [(h, glu * ffn / tp), (ffn / tp, h)]
    else:
        ffn, local = cfg.moe_ffn_hidden_size / etp, cfg.num_experts // ep
        routed = tokens * routed_tokens(cfg, tp, etp)
        rows = routed + local * (127 if blockwise else 15)
        experts = sum(rows * (k + n) * elem - routed * (k + n) * act + (0 if blockwise else 8 * local)
                      for k, n in ((h, glu * ffn), (ffn, h)))
        shared = cfg.moe_shared_expert_intermediate_size
        if shared:
            linears += [(h, glu * shared / tp), (shared / tp, h)]
    return experts + sum(tokens * (k + n) * (elem - act) + (0 if blockwise else 8) for k, n in linears)


@dataclass(frozen=True)
class ZeroPlan:
    """DeepSpeed's optimizer path: its ZeRO stage and the ``zero_optimization`` keys that size its buffers."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's defaults (runtime/zero/config.py)
    overlap_comm: Optional[bool] = None  # None: DeepSpeed's default, on at stage 3 only
    contiguous_gradients: bool = True

    @classmethod
    def from_section(cls, zero) -> "ZeroPlan":
        return cls(stage=int(zero.get("stage", 0) or 0),
                   reduce_bucket_size=int(zero.get("reduce_bucket_size", cls.reduce_bucket_size)),
                   overlap_comm=zero.get("overlap_comm"),
                   contiguous_gradients=bool(zero.get("contiguous_gradients", True)))

    def bucket_elements(self) -> int:
        """The reduction bucket's elements (stages 1 to 3): two buckets with ``overlap_comm`` at stages 1 and 2."""
        if self.stage == 0 or not self.contiguous_gradients and self.stage < 3:
            return 0
        return self.reduce_bucket_size * (2 if self.stage < 3 and self.overlap_comm else 1)


def zero_state_bytes(zero: ZeroPlan, params: int, dense_owned: int, expert_owned: int, params_dtype: str,
                     state_bytes_per_param: int):
    """``(model params, grads, fp32 main params, fp32 main grads, optimizer states)`` on a rank of DeepSpeed's
    optimizer path holding ``params`` parameters and the partitions of ``dense_owned`` dense and ``expert_owned``
    expert ones (see the module docstring).  ZeRO makes the fp32 gradients of one param group at a time, for its
    step: the larger of the dense and expert partitions is planned (its biases and norms, a group of their own,
    counted with it)."""
    low, mixed = BYTES[params_dtype], params_dtype != "fp32"
    if zero.stage == 0:
        return (params * low, params * low, 4 * params if mixed else 0, 4 * params if mixed else 0,
                params * state_bytes_per_param)
    owned = dense_owned + expert_owned
    grads = (params if zero.stage == 1 else owned) * low + zero.bucket_elements() * low
    return (owned * low if zero.stage == 3 else params * low, grads, 4 * owned, 4 * max(dense_owned, expert_owned),
            owned * state_bytes_per_param)


@dataclass(frozen=True)
class RankMemory:
    """The memory plan of the ranks that share one role."""

    role: str
    ranks: List[int]
    params: int
    params_sharded: int
    params_replicated: int
    params_expert: int
    model_param_bytes: int
    grad_bytes: int
    main_param_bytes: int
    main_grad_bytes: int  # fp32 main grads of 16-bit gradients, alive during the optimizer step only
    optimizer_state_bytes: int
    activation_bytes: int  # of all micro-batches in flight at once
    in_flight_micro_batches: int = 1  # chunk-forwards alive at the peak (1F1B: min(pp - stage, micro-batches))
    layers: List[int] = field(default_factory=list)  # the transformer layers these ranks hold
    fp8_scaling_bytes: int = 0  # the delayed recipe's amax histories and scales (fp8_scaling_state_bytes)

    @property
    def total_bytes(self) -> int:
        return (self.model_param_bytes + self.grad_bytes + self.main_param_bytes + self.main_grad_bytes
                + self.optimizer_state_bytes + self.activation_bytes + self.fp8_scaling_bytes)


def fp8_scaling_state_bytes(cfg, layers: Sequence[int], last_stage: bool = True, ep: int = 1) -> int:
    """The delayed recipe's scaling state of a rank's fp8 linears (``fp8.FP8LinearState``), kept from the model's
    build on: per linear and tensor role (input, weight, output gradient) an fp32 amax history of
    ``fp8_amax_history_len``, the scale and the step's running amax.  A layer's fp8 linears are its attention's
    (``attention_fp8_linears``: QKV and the projection, or MLA's five or four projections) and fc1 and fc2, an MoE
    layer's each local expert's fc1 and fc2 and the shared expert's instead (the last stage's multi-token-prediction
    layers too).  The kept scale copies of a micro-batch are activations
    (``fp8_layer_bytes``); tensorwise and blockwise keep no state."""
    if cfg.fp8 is None or cfg.fp8_recipe != "delayed":
        return 0
    mtp = [cfg.num_layers + k for k in range(cfg.mtp_num_layers or 0)] if last_stage else []
    shared = 2 if cfg.moe_shared_expert_intermediate_size else 0
    attention = len(attention_fp8_linears(cfg, 1))
    linears = sum((attention + (2 * cfg.num_experts // ep + shared if cfg.is_moe_layer(i) else 2))
                  * cfg.fp8_layer(i) for i in list(layers) + mtp)
    return linears * 3 * (cfg.fp8_amax_history_len + 2) * 4


def fp8_weight_elements(cfg, layers: Sequence[int], tp: int, last_stage: bool = True, ep: int = 1,
                        etp: int = 1) -> int:
    """Elements per rank of the weights that ``fp8_param_gather`` keeps as fp8 bytes: QKV and the projection (MLA:
    its split projections, not the replicated down-projections) and the MLP's fc1 and fc2 of every fp8 layer among
    ``layers`` (and the last stage's multi-token-prediction layers); in an MoE layer the local experts' fc1 and fc2
    (``num_experts / ep`` of them, split over ETP) and the shared expert's instead of the dense MLP.  Their biases,
    the norms, the router, embeddings and output layer stay 16-bit."""
    h, glu = cfg.hidden_size, 2 if cfg.gated_linear_unit else 1
    attention = int(sum(k * n for k, n, _, split in attention_fp8_linears(cfg, tp) if split))

    def mlp(layer: int) -> int:
        if not cfg.is_moe_layer(layer):
            return h * (glu + 1) * cfg.ffn_hidden_size // tp
        experts = (cfg.num_experts // ep) * h * (glu + 1) * (cfg.moe_ffn_hidden_size // etp)
        return experts + h * (glu + 1) * (cfg.moe_shared_expert_intermediate_size or 0) // tp

    mtp = [cfg.num_layers + k for k in range(cfg.mtp_num_layers or 0)] if last_stage else []
    return sum(attention + mlp(i) for i in list(layers) + mtp if cfg.fp8_layer(i))


def plan_memory(cfg, layout, params_dtype: str = "fp32", optimizer_type: str = "adamw", momentum: float = 0.0,
                micro_batch: int = 1, distributed_optimizer: bool = False, micro_batches: int = 1,
                partition_method: str = "uniform", layers_per_stage: Optional[Sequence[int]] = None,
                first: Optional[int] = None, last: Optional[int] = None, schedule: str = "1f1b",
                num_model_chunks: int = 1, group_size: Optional[int] = None,
                deepspeed_engine: bool = False, grad_reduce_in_fp32: Optional[bool] = None,
                hierarchical_inner: Optional[int] = None, zero: Optional[ZeroPlan] = None,
                fp8_param_gather: bool = False, rank_lists: bool = True,
                kernels: DeviceKernels = CPU_KERNELS) -> List[RankMemory]:
    """One ``RankMemory`` per (pipeline stage, TP rank index): the ranks holding the same shards
    (``rank_lists=False``: one per stage, its ``ranks`` empty; the TP ranks' bytes are the same).

    ``distributed_optimizer``: fp32 main params, main grads and optimizer states
    are this rank's shard, ``1/DP`` of the dense params and ``1/EDP`` of the
    expert ones (the buffers' alignment padding, at most 63 elements per param
    plus a bucket's ``lcm(DP, 128)``, is left out).  With PP, each stage holds
    its layers (split as ``config.pipeline`` does: ``partition_method``,
    ``layers_per_stage``, ``first`` / ``last``: Megatron's
    ``decoder_first/last_pipeline_num_layers``), the embedding on the first and the final norm and
    tied output copy on the last, and keeps the activations of up to
    ``pp - stage`` of the step's ``micro_batches`` (1F1B's in-flight count).

    Gradients are what our path allocates: one gradient buffer per rank holding every parameter's gradient
    (not sharded, also with the distributed optimizer, whose reduce-scatter leaves each rank's shard in it),
    in fp32 with ``grad_reduce_in_fp32`` (None: on for 16-bit params, Megatron's default), where the
    optimizer's fp32 main grads are views of it (no bytes of their own); with 16-bit gradients the optimizer
    makes fp32 main grads of the parameters it owns for the step.  So bf16 params with fp32 grads and Adam
    take 2 + 4 + 4 + 8 = 18 bytes per parameter, and 2 + 4 + 12 / DP with the distributed optimizer
    (megatron-core's table).  ``deepspeed_engine``: the stage
    runs on DeepSpeed's ``PipelineEngine`` (a ``GPTPipelineModule``: no chunk output kept beside the
    activations, no receive posted ahead) instead of our runtime.  ``zero``: DeepSpeed's optimizer path holds the
    params, gradients, fp32 copies and optimizer states as its ZeRO stage allocates them (``zero_state_bytes``).
    ``fp8_param_gather``: the fp8 layers' weights are 1 byte each (``fp8_weight_elements``), the rest 16-bit.
    ``kernels``: the device whose kernels' habits the activations follow (``planning.hardware.DeviceKernels``).
    """
    if layout.cp > 1:
        cfg.check_context_parallel(layout.cp, layout.tp)
    pp, v = layout.pp, num_model_chunks
    chunks = pipeline_rank_chunks(cfg, layout, partition_method, layers_per_stage, first, last, v)
    ranges = [[i for chunk in stage_chunks for i in chunk] for stage_chunks in chunks]
    low = BYTES[params_dtype]
    mixed = params_dtype != "fp32"
    grad_elem = 4 if (mixed if grad_reduce_in_fp32 is None else grad_reduce_in_fp32) else low
    groups = layout.group_ranks() if rank_lists else None
    plans = []
    for stage, layers in enumerate(ranges):
        counts = gpt_param_counts(cfg, layout.tp, layout.ep, layout.etp, layers, first_stage=stage == 0,
                                  last_stage=stage == pp - 1)
        n = counts.total
        # Parameters whose fp32 copies and optimizer state this rank keeps.
        dense_shard = -(-(counts.sharded + counts.replicated) // layout.dp)
        expert_shard = -(-counts.expert // layout.edp)
        owned = dense_shard + expert_shard if distributed_optimizer else n
        # Each chunk's kept set for every micro-batch in flight; the transients of one backward (the head's, a
        # layer's, the cores') once, at the largest chunk's.
        chunk_args = [dict(logits=stage == pp - 1 and c == v - 1, cp=layout.cp, layers=chunk, etp=layout.etp,
                           ep=layout.ep, hierarchical_inner=hierarchical_inner, embedding=stage == 0 and c == 0,
                           kernels=kernels, deferred=schedule == "zero_bubble")
                      for c, chunk in enumerate(chunks[stage])]
        per_chunk = [activation_bytes(cfg, layout.tp, micro_batch, params_dtype, kept_only=True, **a)
                     for a in chunk_args]
        transient = max(activation_bytes(cfg, layout.tp, micro_batch, params_dtype, **a) - kept
                        for a, kept in zip(chunk_args, per_chunk))
        ours = not deepspeed_engine
        sp = cfg.sequence_parallel and layout.tp > 1
        message = cfg.seq_length // layout.cp // (layout.tp if sp else 1) * micro_batch * cfg.hidden_size * low
        if ours:  # a chunk before the last virtual stage also keeps its output until its backward
            per_chunk = [n + (0 if stage == pp - 1 and c == v - 1 else message) for c, n in enumerate(per_chunk)]
        deferred = [deferred_weight_grad_bytes(cfg, layout.tp, micro_batch, params_dtype, chunk, layout.cp,
                                               logits=stage == pp - 1 and c == v - 1, etp=layout.etp, ep=layout.ep)
                    for c, chunk in enumerate(chunks[stage])] if schedule == "zero_bubble" else None
        activations, in_flight = schedule_peak_activations(per_chunk, micro_batches, pp, stage, schedule,
                                                           group_size, message if ours else 0, deferred)
        activations += transient
        stage_ranks = {p[stage] for p in groups["pp"]} if rank_lists else None  # thousands of groups at 16,384
        for tp_rank in range(layout.tp if rank_lists else 1):
            ranks = sorted(g[tp_rank] for g in groups["tp"] if g[tp_rank] in stage_ranks) if rank_lists else []
            role = f"stage {stage} tp rank {tp_rank}" if pp > 1 else f"tp rank {tp_rank}"
            state_per_param = optimizer_state_bytes_per_param(optimizer_type, momentum)
            if zero is not None:
                columns = zero_state_bytes(zero, n, dense_shard, expert_shard, params_dtype, state_per_param)
            else:
                fp8_weights = (fp8_weight_elements(cfg, layers, layout.tp, stage == pp - 1, layout.ep, layout.etp)
                               if fp8_param_gather else 0)
                columns = (n * low - fp8_weights * (low - 1), n * grad_elem, 4 * owned if mixed else 0,
                           4 * owned if mixed and grad_elem < 4 else 0, owned * state_per_param)
            plans.append(RankMemory(
                role=role, ranks=ranks, params=n, params_sharded=counts.sharded,
                params_replicated=counts.replicated, params_expert=counts.expert, model_param_bytes=columns[0],
                grad_bytes=columns[1], main_param_bytes=columns[2], main_grad_bytes=columns[3],
                optimizer_state_bytes=columns[4], activation_bytes=activations, in_flight_micro_batches=in_flight,
                layers=list(layers), fp8_scaling_bytes=fp8_scaling_state_bytes(cfg, layers, stage == pp - 1,
                                                                                   layout.ep)))
    return plans


def schedule_peak_activations(chunk_bytes: Sequence[int], micro_batches: int, pp: int, rank: int,
                              schedule: str = "1f1b", group_size: Optional[int] = None, message_bytes: int = 0,
                              deferred_bytes: Optional[Sequence[int]] = None):
    """``(bytes, chunk-forwards)`` alive at the peak of ``rank``'s order: each chunk's activations of a
    micro-batch from its forward to its backward, plus the receive buffers the runtime has posted but not yet
    taken (``message_bytes`` each: it posts a neighbour's messages in that neighbour's send order, up to the one
    an operation needs), and the input gradients a backward sent until the receive that releases them
    (``send_releases``; a forward's sent output is its chunk's, released by its backward's receive).  ZB-H1: from
    B to W a chunk keeps ``deferred_bytes`` instead.  DeepSpeed's 1F1B runs the order of ours."""
    if pp == 1:
        return chunk_bytes[0], 1
    v = len(chunk_bytes)
    kind = "zero_bubble" if schedule == "zero_bubble" else "interleaved_1f1b"
    deferred = deferred_bytes or [0] * v
    alive = count = peak = peak_count = 0
    releases = send_releases(micro_batches, v, pp, rank, group_size, kind)
    for (op, posts), released in zip(posted_receives(micro_batches, v, pp, rank, group_size, kind), releases):
        if posts >= 0:
            for _ in range(posts):
                alive += message_bytes
            peak = max(peak, alive)
            alive -= message_bytes  # taken: an activation becomes the chunk's input (counted below)
            alive -= message_bytes * sum(message[0] == "gradient" for _, message in released)
        sent = sends_of(op, rank, pp, v)
        if sent is not None and sent[1][0] == "gradient":
            alive += message_bytes  # the input gradient, in flight to the previous stage
        if op.forward:
            alive, count = alive + chunk_bytes[op.chunk], count + 1
        elif op.part == "input":  # B: the activations go, what W needs stays
            alive += deferred[op.chunk] - chunk_bytes[op.chunk]
        elif op.part == "weight":
            alive, count = alive - deferred[op.chunk], count - 1
        else:
            alive, count = alive - chunk_bytes[op.chunk], count - 1
        if alive > peak:
            peak, peak_count = alive, count
    return peak, peak_count


def _gib(n: int) -> str:
    return f"{n / 2 ** 20:,.2f} MiB"


def _runs(layers: Sequence[int]) -> str:
    """``0-3`` or, for a rank holding several chunks, ``0-1,4-5``."""
    if not layers:
        return "-"
    runs, start = [], layers[0]
    for prev, cur in zip(layers, list(layers[1:]) + [None]):
        if cur != prev + 1 if cur is not None else True:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(runs)


def format_plan(plans: Sequence[RankMemory], header: str) -> str:
    rows = [["role", "ranks", "layers", "params", "model params", "grads", "fp32 main params", "fp32 main grads*",
             "optimizer states", "activations**", "total"]]
    for p in plans:
        layers = _runs(p.layers)
        rows.append([p.role, ",".join(map(str, p.ranks)), layers, f"{p.params:,}", _gib(p.model_param_bytes),
                     _gib(p.grad_bytes), _gib(p.main_param_bytes), _gib(p.main_grad_bytes),
                     _gib(p.optimizer_state_bytes), f"{_gib(p.activation_bytes)} ({p.in_flight_micro_batches} mb)"
                     if p.in_flight_micro_batches > 1 else _gib(p.activation_bytes), _gib(p.total_bytes)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [header, ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines += ["", "* copies of 16-bit gradients, alive during the optimizer step only (with fp32 gradients, the "
                  "default for 16-bit params, the main grads are the gradient buffer itself); ** what the GPT keeps "
                  "for backward per micro-batch, times the micro-batches a stage holds at once (1F1B keeps up to "
                  "pp - stage in flight; with chunks, the peak of the rank's own schedule order), plus one "
                  "backward's transients at their peak (the start of backward or a layer's own backward)"]
    scaling = [p for p in plans if p.fp8_scaling_bytes]
    if scaling:
        lines.append(f"fp8 delayed scaling's amax histories and scales, in the total: "
                     f"{_gib(max(p.fp8_scaling_bytes for p in scaling))} per rank at most")
    return "\n".join(lines)
