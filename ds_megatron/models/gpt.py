"""Megatron's GPT: vocab-parallel embedding (+ learned positions), N pre-norm layers, final norm, output layer.

The defaults are GPT-2 (learned positions, LayerNorm, GELU, biases, output
tied to the word embedding); ``GPTConfig``'s architecture fields give Llama,
Mistral, Qwen2 and the Mixtral / Qwen-MoE shapes (RoPE, RMSNorm, SwiGLU, GQA,
a separate ``output_layer``).

Tensors flow as [sequence, batch, hidden] inside the model, as in Megatron.
The output layer reuses the word-embedding shard, so the logits come out
vocab-parallel ([s, b, V/tp]) and go straight into the vocab-parallel cross
entropy: the full logits are never gathered.  The padded vocab rows are
zero and their logits are excluded from the softmax, so padding never wins
and the loss does not depend on the TP size.

Construction draws every full (master) weight from the default torch RNG in
the same order whatever the TP size, so TP=1, 2, 4 built after the same seed
hold the same full model.  ``build_gpt_modules`` is that order, piece by
piece: ``GPTModel`` keeps every piece, a pipeline stage
(``integration.pipeline``) keeps its own, so any PP size built after the same
seed holds the same full model too.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config.model import GPTConfig
from ..fp8 import FP8Recipe
from ..moe.aux_loss_scaler import RoutingLossGradient, reentrant_rerun_hook
from ..moe.aux_loss_tracker import MoEAuxLossTracker
from ..moe.moe_layer import BaseMoELayer, MoELayer
from ..parallel_state import ParallelGroup, ParallelState
from ..tensor_parallel import (LogitsBuffer, RNGStatesTracker, VocabParallelEmbedding, checkpoint,
                               copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                               gather_from_tensor_model_parallel_region,
                               init_method_normal, linear_vocab_parallel_cross_entropy, pad_vocab_size,
                               scaled_init_method_normal, scatter_to_sequence_parallel_region,
                               vocab_parallel_cross_entropy)
from ..tensor_parallel import ColumnParallelLinear
from ..tensor_parallel.layers import attach_fp8
from ..tensor_parallel.weight_grad_store import WeightGradStore, linear
from ..transformer import ParallelTransformerLayer
from ..transformer.context_parallel import zigzag_chunk_indices, zigzag_split
from ..transformer.attention import soft_cap
from ..transformer.layer import set_recompute_method
from ..transformer.mlp import build_mlp
from ..transformer.packed_seq_params import PackedSeqParams, shift_left
from ..utils.collectives import all_reduce
from ..transformer.norm import build_norm

_GLIBC_ALWAYS_MAPS = 32 * 2 ** 20  # glibc's largest dynamic mmap threshold (64-bit): bigger buffers are mapped afresh


class PositionEmbedding(torch.nn.Module):
    """The input embedding after the vocab lookup: learned positions added, [b, s, h] -> [s, b, h], dropout.

    With ``position_embedding_type`` "rope" or "none" it has no weight (RoPE turns q and k in attention).

    Under sequence parallelism the result is this rank's slice of the sequence.  With context parallelism the
    input is this CP rank's two zigzag chunks (``ContextParallelVocabEmbedding``), and so are the positions.  In
    a packed micro-batch (``packed_seq_params``) the positions are each token's place in its document.
    A module of its own so that a pipeline's first stage runs it after the
    (tied) word embedding; ``GPTModel`` holds it as ``position_embeddings``.
    """

    def __init__(self, config: GPTConfig, tp: ParallelGroup, rng_tracker: Optional[RNGStatesTracker], init_method,
                 cp: Optional[ParallelGroup] = None):
        super().__init__()
        self.config, self.tp, self.rng_tracker = config, tp, rng_tracker
        self.cp = cp if cp is not None else ParallelGroup.single("cp")
        self.weight = None
        if config.position_embedding_type == "learned_absolute":
            self.weight = torch.nn.Parameter(torch.empty(config.seq_length, config.hidden_size))
            # N(0, 1) first, as the torch.nn.Embedding this replaces drew at construction: the RNG stream, and
            # so every later weight, stays that of earlier versions (same seed, same model).
            torch.nn.init.normal_(self.weight)
            init_method(self.weight)

    def forward(self, word_embedded: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        s = word_embedded.size(1) * self.cp.size  # with CP: this rank's two zigzag chunks of s tokens
        if s > self.config.seq_length:
            raise ValueError(f"input has {s} tokens but model.seq_length is {self.config.seq_length}")
        if self.config.apply_embedding_scaling:
            # Gemma: sqrt(hidden) rounded to the embedding's dtype first, as transformers does
            word_embedded = word_embedded * torch.tensor(self.config.hidden_size ** 0.5, dtype=word_embedded.dtype,
                                                         device=word_embedded.device)
        if packed_seq_params is not None:
            if self.weight is not None:
                word_embedded = word_embedded + self.weight[packed_seq_params.local_position_ids]
        elif self.cp.size > 1:
            if self.weight is not None:
                positions = zigzag_chunk_indices(s, self.cp.size, self.cp.rank).to(word_embedded.device)
                word_embedded = word_embedded + self.weight[positions]
        elif self.weight is not None:
            word_embedded = word_embedded + self.weight[:s]
        hidden = word_embedded.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp)
        if self.training and self.config.hidden_dropout > 0:
            # Outside the TP region every TP rank holds the same values and must drop the same
            # entries (default RNG); a sequence-parallel slice is rank-specific (tracker RNG).
            fork = self.rng_tracker.fork() if (self.config.sequence_parallel and self.rng_tracker) \
                else contextlib.nullcontext()
            with fork:
                hidden = F.dropout(hidden, p=self.config.hidden_dropout)
        return hidden


class ContextParallelVocabEmbedding(VocabParallelEmbedding):
    """The word embedding of a context-parallel rank: every CP rank receives the whole sample and looks up only
    its two zigzag chunks (Megatron's ``get_batch_on_this_cp_rank``), so that the lookup and its all-reduce over
    TP cover ``s / cp`` tokens.  Its weight is a ``VocabParallelEmbedding``'s, under the same name.  In a packed
    micro-batch the rank's tokens are its chunks of every document (``PackedSeqParams.local``)."""

    def __init__(self, *args, cp: ParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp = cp

    def forward(self, input_ids: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if packed_seq_params is not None:
            return super().forward(packed_seq_params.local(input_ids))
        return super().forward(zigzag_split(input_ids, self.cp.size, self.cp.rank, seq_dim=1))


def embed(word_embeddings: torch.nn.Module, position_embeddings: PositionEmbedding, tokens: torch.Tensor,
          packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """Token ids [b, s] -> the first layer's input [s(/tp), b, h]: this CP rank's tokens, a packed micro-batch's
    positions within their documents."""
    if isinstance(word_embeddings, ContextParallelVocabEmbedding):
        words = word_embeddings(tokens, packed_seq_params)
    else:
        words = word_embeddings(tokens)
    return position_embeddings(words, packed_seq_params)


def softcap_logits(logits: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """``final_logit_softcapping`` (Gemma): ``cap * tanh(logits / cap)``, per logit (so per vocab shard); the
    padded vocab's 0 stays 0 and is masked out of the softmax as before."""
    return soft_cap(logits, config.final_logit_softcapping)


class OutputLayer(ColumnParallelLinear):
    """The untied output layer (``untie_embeddings_and_output_weights``): column-parallel over the padded vocab,
    no bias; ``forward(hidden [s(/tp), b, h])`` -> this rank's vocab-parallel logits [s, b, V/tp] (soft-capped by
    ``softcap``: ``final_logit_softcapping``)."""

    def __init__(self, *args, softcap: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().forward(hidden)[0], self.softcap)


def _output_layer_input(hidden: torch.Tensor, config: GPTConfig, tp: ParallelGroup) -> torch.Tensor:
    """Final hidden states [s(/tp), b, h] -> the full [s, b, h] every TP rank's vocab slice multiplies."""
    if config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tp, tensor_parallel_output_grad=True)
    return copy_to_tensor_model_parallel_region(hidden, tp)


def output_logits(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor, config: GPTConfig,
                  tp: ParallelGroup, weight_grad_store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """Final hidden states [s(/tp), b, h] -> this rank's vocab-parallel logits [s, b, V/tp] (the tied output layer;
    the zero-bubble schedule's ``weight_grad_store`` may defer its weight gradient), soft-capped when configured."""
    return softcap_logits(linear(_output_layer_input(hidden, config, tp), word_embeddings_weight, None,
                                 weight_grad_store), config)


def output_layer_loss(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor, labels: torch.Tensor,
                      loss_mask: Optional[torch.Tensor], config: GPTConfig, tp: ParallelGroup,
                      buffer: Optional[LogitsBuffer], cp: Optional[ParallelGroup] = None,
                      weight_grad_store: Optional[WeightGradStore] = None,
                      packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """``language_model_loss(output_logits(...), ...)`` in one function: the logits never leave the loss, so they
    are made transposed ([V/tp, tokens], the faster CPU GEMM) and, with ``buffer``, in storage kept from step
    to step."""
    labels, loss_mask = _labels_of_this_cp_rank(labels, loss_mask, cp, packed_seq_params)
    hidden = _output_layer_input(hidden, config, tp)
    losses = linear_vocab_parallel_cross_entropy(hidden, word_embeddings_weight, labels.transpose(0, 1), tp,
                                                 label_smoothing=config.label_smoothing,
                                                 vocab_size=config.vocab_size, buffer=buffer,
                                                 weight_grad_store=weight_grad_store).transpose(0, 1)
    return _masked_mean(losses, loss_mask, cp)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                        config: GPTConfig, tp: ParallelGroup, inplace: bool = False,
                        cp: Optional[ParallelGroup] = None,
                        packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """Mean vocab-parallel cross entropy of ``logits [s, b, V/tp]`` against ``labels [b, s]`` over the masked tokens.

    ``inplace``: the loss may work in the logits' storage (nothing else reads them).  Not on a pipeline's
    last stage: there the logits are the stage's output, which DeepSpeed keeps and our loss-scale hook watches.

    ``cp`` with more than one rank: the logits are this rank's zigzag chunks and ``labels`` / ``loss_mask``
    the whole sample's.  The value is the mean over the whole sequence (masked loss sums and token counts
    summed over ``cp``, Megatron's way); the gradient is ``cp`` x this rank's share, so that the gradient
    buffers' mean over dp-cp gives the CP=1 gradient.

    ``packed_seq_params``: a packed micro-batch's documents (no document's last token is trained; with CP the
    rank's tokens are its chunks of every document).
    """
    labels, loss_mask = _labels_of_this_cp_rank(labels, loss_mask, cp, packed_seq_params)
    losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), tp, label_smoothing=config.label_smoothing,
                                          vocab_size=config.vocab_size, inplace=inplace).transpose(0, 1)
    return _masked_mean(losses, loss_mask, cp)


def tiled_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
               config: GPTConfig, tp: ParallelGroup, cp: Optional[ParallelGroup],
               packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """``language_model_loss`` over ``config.loss_sequence_tiles`` sequence tiles: each tile's logits
    [tile, b, V/tp] are made, turned into per-token losses and dropped, and made again in backward (a checkpoint
    per tile), so no [s, b, V/tp] tensor ever exists.  The same mean over the masked tokens."""
    labels, loss_mask = _labels_of_this_cp_rank(labels, loss_mask, cp, packed_seq_params)
    x = _output_layer_input(hidden, config, tp)  # [s, b, h], gathered once
    bounds = torch.tensor_split(torch.arange(x.size(0)), min(config.loss_sequence_tiles, x.size(0)))

    def tile_losses(x_tile: torch.Tensor, w: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        logits = softcap_logits(F.linear(x_tile, w), config)  # [tile, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels[:, start:stop].transpose(0, 1), tp,
                                            label_smoothing=config.label_smoothing, vocab_size=config.vocab_size,
                                            inplace=True)
    pieces = [checkpoint(tile_losses, None, x[int(b[0]):int(b[-1]) + 1], weight, int(b[0]), int(b[-1]) + 1)
              for b in bounds if b.numel()]
    return _masked_mean(torch.cat(pieces, dim=0).transpose(0, 1), loss_mask, cp)


def _labels_of_this_cp_rank(labels: torch.Tensor, loss_mask: Optional[torch.Tensor], cp: Optional[ParallelGroup],
                            packed: Optional[PackedSeqParams] = None):
    """The whole sample's labels / loss mask -> this CP rank's zigzag chunks (unchanged without CP).  Packed: every
    document's last token left out of the mask, and with CP the rank's chunks of every document."""
    if packed is not None:
        return packed.local(labels), packed.local(packed.loss_mask(loss_mask))
    if cp is None or cp.size == 1:
        return labels, loss_mask
    labels = zigzag_split(labels, cp.size, cp.rank, seq_dim=1)
    return labels, None if loss_mask is None else zigzag_split(loss_mask, cp.size, cp.rank, seq_dim=1)


def _masked_mean(losses: torch.Tensor, loss_mask: Optional[torch.Tensor],
                 cp: Optional[ParallelGroup] = None) -> torch.Tensor:
    """Mean of ``losses`` over the masked tokens; with CP over the whole sequence (see ``language_model_loss``)."""
    cp_size = cp.size if cp is not None else 1
    if cp_size == 1:
        if loss_mask is None:
            return losses.mean()
        loss_mask = loss_mask.to(losses.dtype)
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    loss_mask = torch.ones_like(losses) if loss_mask is None else loss_mask.to(losses.dtype)
    local = (losses * loss_mask).sum()
    totals = torch.stack([local.detach(), loss_mask.sum()])
    all_reduce(totals, cp)
    count = totals[1].clamp(min=1)
    scaled = local * cp_size / count
    return scaled + (totals[0] / count - scaled).detach()


def build_gpt_modules(config: GPTConfig, parallel_state: ParallelState, rng_tracker: Optional[RNGStatesTracker],
                      aux_loss_tracker: Optional[MoEAuxLossTracker]) -> Iterator[Tuple[str, torch.nn.Module]]:
    """Every piece of the GPT in construction (RNG) order, as ``(name in GPTModel, module)``.

    ``word_embeddings``, ``position_embeddings``, ``layers.0`` ... ``layers.N-1``,
    ``final_layernorm``, and ``output_layer`` when it is not tied to the word embedding.  A generator: a caller that keeps only some pieces
    drops the others as they come (peak memory: what it keeps plus one piece).
    """
    tp = parallel_state.tp
    padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp.size)
    init = init_method_normal(config.init_method_std)
    out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)

    def embedding_init(weight):
        # Only the real rows are drawn, so the RNG stream (and every later
        # weight) does not depend on how much padding this TP size needs.
        init(weight[:config.vocab_size])
        with torch.no_grad():
            weight[config.vocab_size:].zero_()

    if parallel_state.cp.size > 1:
        yield "word_embeddings", ContextParallelVocabEmbedding(padded_vocab_size, config.hidden_size, tp=tp,
                                                               init_method=embedding_init, cp=parallel_state.cp)
    else:
        yield "word_embeddings", VocabParallelEmbedding(padded_vocab_size, config.hidden_size, tp=tp,
                                                        init_method=embedding_init)
    yield "position_embeddings", PositionEmbedding(config, tp, rng_tracker, init, cp=parallel_state.cp)

    def mlp(layer_number: int) -> torch.nn.Module:
        if config.is_moe_layer(layer_number):
            return MoELayer(config, parallel_state, layer_number=layer_number, init_method=init,
                            output_init_method=out_init, aux_loss_tracker=aux_loss_tracker)
        return build_mlp(config, config.hidden_size, config.ffn_hidden_size, tp=tp, init_method=init,
                         output_init_method=out_init, sequence_parallel=config.sequence_parallel)

    hcp = None
    if config.cp_comm_type == "a2a+p2p" and parallel_state.cp.size > 1:
        hcp = parallel_state.hierarchical_context_parallel
        if hcp is None:
            raise ValueError("model.cp_comm_type \"a2a+p2p\" needs the hierarchical CP groups: build the "
                             "ParallelState from a config with megatron.hierarchical_context_parallel_sizes")
    fp8 = FP8Recipe.from_config(config)  # the transformer layers' linears and experts only, as in Megatron
    amax_group = parallel_state["tp-cp"]  # CP splits the sequence: the linears' amaxes agreed over TP x CP
    for i in range(config.num_layers):
        layer = ParallelTransformerLayer(config, tp=tp, build_mlp=functools.partial(mlp, i), init_method=init,
                                         output_init_method=out_init, rng_tracker=rng_tracker, cp=parallel_state.cp,
                                         hierarchical_cp=hcp, layer_number=i)
        attach_fp8(layer, fp8 if config.fp8_layer(i) else None, amax_group)
        yield f"layers.{i}", layer
    yield "final_layernorm", build_norm(config, config.hidden_size, sequence_parallel=config.sequence_parallel)
    if config.untie_embeddings_and_output_weights:
        yield "output_layer", OutputLayer(config.hidden_size, padded_vocab_size, tp=tp, bias=False,
                                          init_method=embedding_init, sequence_parallel=config.sequence_parallel,
                                          softcap=config.final_logit_softcapping)
    for k in range(config.mtp_num_layers or 0):
        mtp = MultiTokenPredictionLayer(config, parallel_state, rng_tracker, init, out_init,
                                        functools.partial(mlp, config.num_layers + k), hcp, config.num_layers + k)
        # eh_proj stays 16-bit
        attach_fp8(mtp.layer, fp8 if config.fp8_layer(config.num_layers + k) else None, amax_group)
        yield f"mtp.{k}", mtp


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth of DeepSeek-V3's multi-token prediction (megatron-core's ``MultiTokenPredictionLayer``):
    ``eh_proj([enorm(embedding of the tokens k ahead); hnorm(previous depth's hidden)])`` through one transformer
    layer and its own final norm, then the shared output layer.  ``eh_proj`` is column-parallel, its output
    gathered over TP (and scattered over the sequence with sequence parallelism) for the layer.

    Context parallelism needs nothing more: every CP rank has the whole sample's tokens and labels, so the tokens
    and labels k ahead are shifted whole and then cut into the rank's zigzag chunks, like the main model's."""

    def __init__(self, config: GPTConfig, state: ParallelState, rng_tracker, init, out_init, build_mlp,
                 hierarchical_cp=None, layer_number: int = 0):
        super().__init__()
        h, sp = config.hidden_size, config.sequence_parallel
        self.tp, self.sequence_parallel = state.tp, sp and state.tp.size > 1
        self.enorm = build_norm(config, h, sequence_parallel=sp)
        self.hnorm = build_norm(config, h, sequence_parallel=sp)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp=state.tp, bias=False,
                                            gather_output=not self.sequence_parallel, init_method=init,
                                            sequence_parallel=sp)
        self.layer = ParallelTransformerLayer(config, tp=state.tp, build_mlp=build_mlp, init_method=init,
                                              output_init_method=out_init, rng_tracker=rng_tracker, cp=state.cp,
                                              hierarchical_cp=hierarchical_cp, layer_number=layer_number)
        self.final_layernorm = build_norm(config, h, sequence_parallel=sp)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """``embedded``, ``hidden`` (the previous depth's, or the main model's after its final norm, as in
        megatron-core): [s(/tp), b, h] -> this depth's hidden states after its final norm.  A packed micro-batch's
        documents are the main model's: position i still attends within its document, and only positions whose
        label k ahead lies in the same document are trained (``mtp_loss``)."""
        x, _ = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        if self.sequence_parallel:  # [s, b, h/tp] (the sequence gathered for the projection) -> [s/tp, b, h]
            x = scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(x, self.tp), self.tp)
        return self.final_layernorm(self.layer(x, packed_seq_params))


def language_model_head(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor,
                        output_layer: Optional[torch.nn.Module], labels: Optional[torch.Tensor],
                        loss_mask: Optional[torch.Tensor], config: GPTConfig, tp: ParallelGroup,
                        cp: ParallelGroup, logits_buffer: Optional[LogitsBuffer],
                        weight_grad_store: Optional[WeightGradStore] = None,
                        packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """The final hidden states [s(/tp), b, h] -> the mean loss over the masked tokens (with ``labels``), else this
    rank's vocab-parallel logits [b, s, V/tp].  ``output_layer``: the untied one, None when tied to the word
    embedding (``word_embeddings_weight``).  The whole model and a pipeline's last chunk end here.  With
    ``packed_seq_params`` no document's last token is trained (its label is the next document's).

    ``weight_grad_store`` (the zero-bubble schedule's) may defer the tied output layer's weight gradient (the
    untied one holds its own); deferred, the logits' gradient lives on to W.  Not under ``loss_sequence_tiles``:
    deferring every tile's W would keep every tile's logits gradient, the whole [s, b, V/tp] the tiles avoid."""
    weight = word_embeddings_weight
    if labels is not None and config.loss_sequence_tiles > 1 and torch.is_grad_enabled():
        return tiled_loss(hidden, weight if output_layer is None else output_layer.weight, labels, loss_mask, config,
                          tp, cp, packed_seq_params)
    if (labels is not None and output_layer is None and weight.dtype in (torch.float32, torch.float64)
            and config.final_logit_softcapping is None):  # the fused loss takes the output GEMM's logits as they are
        # 16-bit weights keep the separate GEMM below: the fused loss would add a 16-bit gradient to its
        # fp32 logits.  On a CPU, fp32 logits of 32 MiB or more go into a buffer kept across steps: glibc
        # maps buffers that large anew on every allocation (a page fault per page, every step).  A GPU's
        # caching allocator reuses memory already; under recomputation memory matters more than faults.
        keep = (logits_buffer is not None and hidden.device.type == "cpu" and config.recompute_granularity is None
                and weight_grad_store is None
                and labels.numel() * weight.size(0) * weight.element_size() >= _GLIBC_ALWAYS_MAPS)
        return output_layer_loss(hidden, weight, labels, loss_mask, config, tp, logits_buffer if keep else None,
                                 cp=cp, weight_grad_store=weight_grad_store, packed_seq_params=packed_seq_params)
    if output_layer is not None:
        logits = output_layer(hidden)
    else:
        logits = output_logits(hidden, weight, config, tp, weight_grad_store)  # [s, b, V/tp]
    if labels is None:
        return logits.transpose(0, 1)
    # The logits are this forward's own and read by nothing else: the loss may overwrite them.
    return language_model_loss(logits, labels, loss_mask, config, tp, inplace=True, cp=cp,
                               packed_seq_params=packed_seq_params)


MTP_LOSS = "mtp_loss"  # its name in the training log, beside the routing losses


def mtp_loss(mtp_layers, word_embeddings, position_embeddings, tokens, labels, loss_mask, hidden,
             output_layer: Optional[torch.nn.Module], config: GPTConfig, tp: ParallelGroup, cp: ParallelGroup,
             tracker, weight_grad_store: Optional[WeightGradStore] = None,
             packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
    """``mtp_loss_scaling_factor`` x the mean over depths of each depth's loss (depth k, from 1: the main model's
    labels k tokens further on, the last k positions masked; packed: shifted inside each document, as for each
    document alone); recorded in ``tracker`` as "mtp_loss" (the mean) in training.
    ``hidden``: the main model's after its final norm.  The whole model and a pipeline's last chunk end here."""
    packed = packed_seq_params
    mask = torch.ones_like(labels, dtype=torch.float64) if loss_mask is None else loss_mask
    if packed is not None:
        mask = packed.loss_mask(mask)
    total = 0.0
    shift = shift_left if packed is None else packed.shift_left  # packed: inside each document
    for k, module in enumerate(mtp_layers, start=1):
        embedded = embed(word_embeddings, position_embeddings, shift(tokens, k), packed)
        hidden = module(embedded, hidden, packed)
        total = total + language_model_head(hidden, word_embeddings.weight, output_layer, shift(labels, k),
                                            shift(mask, k), config, tp, cp, None, weight_grad_store, packed)
    mean = total / len(mtp_layers)
    if mtp_layers.training:  # the log's is the training loss (an evaluation's is not mixed into it)
        tracker.record(MTP_LOSS, 0, mean)
    return config.mtp_loss_scaling_factor * mean


def moe_aux_loss_sum(layers) -> torch.Tensor:
    """The routing losses (load balancing, z) of the last forward of ``layers``, summed; 0 without MoE layers."""
    return sum((sum(layer.mlp.aux_losses.values(), 0.0) for layer in layers
                if isinstance(getattr(layer, "mlp", None), BaseMoELayer)), 0.0)


class GPTModel(torch.nn.Module):
    """``forward(tokens, labels=None, loss_mask=None)`` (or a dict batch with those keys).

    With labels: the mean loss over the masked tokens (a scalar).  Without:
    this rank's vocab-parallel logits, [b, s, V_padded / tp].

    Context parallelism (a ``cp`` group of more than one rank): every CP rank is given the whole sample;
    it computes its two zigzag chunks (``s / cp`` tokens), so the logits are those tokens' (in
    ``zigzag_split`` order) and the loss is the whole sequence's mean (``language_model_loss``).

    Gradients of parameters marked ``sequence_parallel`` are partial sums over
    TP and are completed by whoever reduces the gradients (``finalize_model_grads``
    on the Megatron path), not inside the model.
    """

    def __init__(self, config: GPTConfig, parallel_state: Optional[ParallelState] = None,
                 rng_tracker: Optional[RNGStatesTracker] = None):
        """``parallel_state``: the job's ``ParallelState``; None means one rank (``ParallelState.single()``)."""
        super().__init__()
        state = parallel_state if parallel_state is not None else ParallelState.single()
        config.check_layout(state.layout)
        if state.layout.pp > 1:
            raise ValueError(f"GPTModel is the whole model on every rank but the layout has pp={state.layout.pp}; "
                             "build this rank's part with ds_megatron.GPTModelChunks")
        self.moe_aux_loss_tracker = MoEAuxLossTracker() if config.num_experts else None
        self.config = config
        self.tp, self.cp = state.tp, state.cp
        self.rng_tracker = rng_tracker
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, state.tp.size)
        self.mtp = torch.nn.ModuleList() if config.mtp_num_layers else None
        # The multi-token-prediction loss is logged beside the routing losses (the training loop reads one tracker).
        if config.mtp_num_layers and self.moe_aux_loss_tracker is None:
            self.moe_aux_loss_tracker = MoEAuxLossTracker()
        self.mtp_loss_tracker = self.moe_aux_loss_tracker
        for name, module in build_gpt_modules(config, state, rng_tracker, self.moe_aux_loss_tracker):
            if name.startswith("layers."):
                self.layers.append(module)
            elif name.startswith("mtp."):
                self.mtp.append(module)
            else:
                setattr(self, name, module)
            if name == "position_embeddings":
                self.layers = torch.nn.ModuleList()  # registered here: parameters() follow the build order
        set_recompute_method(self.layers, config)
        # Layers wrapped by hand in a reentrant checkpoint: their reruns take the routing losses' weight from here.
        self.routing_loss_gradient = RoutingLossGradient()
        for layer in list(self.layers) + [m.layer for m in (self.mtp or ())]:
            if isinstance(getattr(layer, "mlp", None), BaseMoELayer):
                layer.mlp.register_forward_hook(reentrant_rerun_hook(self.routing_loss_gradient.weight))
        self.logits_buffer = LogitsBuffer()  # the tied output layer's [V/tp, tokens] logits on a CPU, step to step
        self.weight_grad_store: Optional[WeightGradStore] = None  # may defer the tied output layer's W

    def forward(self, tokens, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None, *,
                position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None):
        """``position_ids`` / ``cu_seqlens`` / ``padding_mask``: a packed micro-batch's documents
        (``PackedSeqParams``); a dict batch may carry them under those keys."""
        if isinstance(tokens, dict):
            batch = tokens
            tokens, labels, loss_mask = batch["tokens"], batch.get("labels"), batch.get("loss_mask")
            position_ids, cu_seqlens = batch.get("position_ids"), batch.get("cu_seqlens")
            padding_mask = batch.get("padding_mask")
        packed = PackedSeqParams.from_batch(tokens, self.cp, position_ids, cu_seqlens, padding_mask)
        hidden = embed(self.word_embeddings, self.position_embeddings, tokens, packed)
        for layer in self.layers:
            hidden = layer(hidden, packed)
        hidden = self.final_layernorm(hidden)
        output_layer = self.output_layer if self.config.untie_embeddings_and_output_weights else None
        out = language_model_head(hidden, self.word_embeddings.weight, output_layer, labels, loss_mask, self.config,
                                  self.tp, self.cp, self.logits_buffer, self.weight_grad_store, packed)
        if labels is None:
            return out
        if self.mtp is not None:
            out = out + mtp_loss(self.mtp, self.word_embeddings, self.position_embeddings, tokens, labels, loss_mask,
                                 hidden, output_layer, self.config, self.tp, self.cp, self.mtp_loss_tracker,
                                 self.weight_grad_store, packed)
        return out + self.moe_aux_loss()

    def moe_aux_loss(self):
        """The routing losses (load balancing, z) of the last forward, summed over MoE layers (the multi-token
        prediction layers' too, as megatron-core's routers add theirs wherever they are); 0 without MoE.  Add it to
        the loss (``forward`` with labels does): layers wrapped in a reentrant checkpoint take its gradient from it."""
        if self.moe_aux_loss_tracker is None:
            return 0.0
        total = moe_aux_loss_sum(list(self.layers) + [m.layer for m in (self.mtp or ())])
        return self.routing_loss_gradient.term(total)
