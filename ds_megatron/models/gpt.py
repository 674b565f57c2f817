"""Megatron's GPT: vocab-parallel embedding + learned positions, N pre-LN layers, final LN, tied output.

Tensors flow as [sequence, batch, hidden] inside the model, as in Megatron.
The output layer reuses the word-embedding shard, so the logits come out
vocab-parallel ([s, b, V/tp]) and go straight into the vocab-parallel cross
entropy: the full logits are never gathered.  The padded vocab rows are
zero and their logits are excluded from the softmax, so padding never wins
and the loss does not depend on the TP size.

Construction draws every full (master) weight from the default torch RNG in
the same order whatever the TP size, so TP=1, 2, 4 built after the same seed
hold the same full model.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..config.model import GPTConfig
from ..moe.aux_loss_tracker import MoEAuxLossTracker
from ..moe.moe_layer import BaseMoELayer, MoELayer
from ..parallel_state import ParallelState
from ..tensor_parallel import (RNGStatesTracker, VocabParallelEmbedding, checkpoint,
                               copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                               init_method_normal, mark_sequence_parallel, pad_vocab_size, scaled_init_method_normal,
                               scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
from ..transformer import ParallelMLP, ParallelTransformerLayer


class GPTModel(torch.nn.Module):
    """``forward(tokens, labels=None, loss_mask=None)`` (or a dict batch with those keys).

    With labels: the mean loss over the masked tokens (a scalar).  Without:
    this rank's vocab-parallel logits, [b, s, V_padded / tp].

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
        tp = state.tp
        self.moe_aux_loss_tracker = MoEAuxLossTracker() if config.num_experts else None
        self.config = config
        self.tp = tp
        self.rng_tracker = rng_tracker
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp.size)
        init = init_method_normal(config.init_method_std)
        out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)

        def embedding_init(weight):
            # Only the real rows are drawn, so the RNG stream (and every later
            # weight) does not depend on how much padding this TP size needs.
            init(weight[:config.vocab_size])
            with torch.no_grad():
                weight[config.vocab_size:].zero_()

        self.word_embeddings = VocabParallelEmbedding(self.padded_vocab_size, config.hidden_size, tp=tp,
                                                      init_method=embedding_init)
        self.position_embeddings = torch.nn.Embedding(config.seq_length, config.hidden_size)
        init(self.position_embeddings.weight)

        def mlp(layer_number: int) -> torch.nn.Module:
            if config.is_moe_layer(layer_number):
                return MoELayer(config, state, layer_number=layer_number, init_method=init,
                                output_init_method=out_init, aux_loss_tracker=self.moe_aux_loss_tracker)
            return ParallelMLP(config.hidden_size, config.ffn_hidden_size, tp=tp, init_method=init,
                               output_init_method=out_init, sequence_parallel=config.sequence_parallel)

        self.layers = torch.nn.ModuleList(
            ParallelTransformerLayer(config, tp=tp, build_mlp=functools.partial(mlp, i), init_method=init,
                                     output_init_method=out_init, rng_tracker=rng_tracker)
            for i in range(config.num_layers))
        self.final_layernorm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        if config.sequence_parallel:
            mark_sequence_parallel(self.final_layernorm)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.size(1)
        if s > self.config.seq_length:
            raise ValueError(f"input has {s} tokens but model.seq_length is {self.config.seq_length}")
        positions = torch.arange(s, device=tokens.device)
        hidden = self.word_embeddings(tokens) + self.position_embeddings(positions)
        hidden = hidden.transpose(0, 1).contiguous()  # [s, b, h]
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

    def forward(self, tokens, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None):
        if isinstance(tokens, dict):
            batch = tokens
            tokens, labels, loss_mask = batch["tokens"], batch.get("labels"), batch.get("loss_mask")
        hidden = self._embed(tokens)
        recompute = self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            # Full recomputation: each layer keeps only its input and reruns in backward, replaying the
            # default generator and this model's tracker streams (the same dropout masks).
            hidden = checkpoint(layer, self.rng_tracker, hidden) if recompute else layer(hidden)
        hidden = self.final_layernorm(hidden)
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp)
        # Tied output layer: this rank's vocab rows of the embedding.
        logits = F.linear(hidden, self.word_embeddings.weight)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)
        # The logits are this forward's own and read by nothing else: the loss may overwrite them.
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.tp,
                                              label_smoothing=self.config.label_smoothing,
                                              vocab_size=self.config.vocab_size, inplace=True).transpose(0, 1)
        if loss_mask is None:
            loss = losses.mean()
        else:
            loss_mask = loss_mask.to(losses.dtype)
            loss = (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        return loss + self.moe_aux_loss()

    def moe_aux_loss(self):
        """The routing losses (load balancing, z) of the last forward, summed over MoE layers; 0 without MoE."""
        if self.moe_aux_loss_tracker is None:
            return 0.0
        return sum(sum(layer.mlp.aux_losses.values(), 0.0) for layer in self.layers
                   if isinstance(layer.mlp, BaseMoELayer))
