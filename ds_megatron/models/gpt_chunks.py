"""The GPT of one pipeline rank as Megatron's model chunks: what our pipeline runtime executes.

With ``p`` pipeline ranks and ``v`` chunks per rank the transformer layers are cut into ``p * v``
virtual stages (``config.pipeline.stage_layer_counts``); rank ``r`` holds virtual stages ``r, r + p,
...`` as its local chunks 0, 1, ...  The first virtual stage also holds the word and position
embeddings, the last the final norm and the output layer (with tied embeddings, a copy of the word
embedding whose gradient ``finalize_model_grads`` sums with the first stage's over the ``embedding``
group).  Every piece comes from ``build_gpt_modules`` in construction order, so any layout built after
the same seed holds the same full model as ``GPTModel``.

``GPTModelChunks`` is the one module DeepSpeed's engine holds (``engine.module``), so that the
gradient buffers, the optimizer and checkpoints see every chunk's parameters; the runtime calls the
chunks themselves.  It names parameters as ``GPTModel`` does (``gpt_name``) for checkpoints and
Hugging Face export.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..config.model import GPTConfig
from ..config.pipeline import rank_layers, stage_layer_counts, stage_layer_ranges
from ..moe.aux_loss_scaler import MoEAuxLossAutoScaler, reentrant_rerun_hook
from ..moe.aux_loss_tracker import MoEAuxLossTracker
from ..moe.moe_layer import BaseMoELayer
from ..parallel_state import ParallelState
from ..tensor_parallel import LogitsBuffer, RNGStatesTracker, is_recomputing, pad_vocab_size
from ..transformer.packed_seq_params import PackedSeqParams
from .gpt import build_gpt_modules, embed, language_model_head, mtp_loss, set_recompute_method


def routing_loss_hook(scale: Callable[[], torch.Tensor]):
    """A forward hook for a transformer layer with an MoE MLP: its routing losses reach the gradients as if added
    to the loss, weighted by ``scale()`` (loss scale / micro-batches), from whichever stage holds the layer.  In
    the forward only: a checkpoint's rerun of the layer is not (a reentrant one's attaches its losses itself,
    ``register_routing_loss_hooks``)."""

    def hook(layer, _inputs, output):
        aux = sum(layer.mlp.aux_losses.values(), 0.0)
        if not torch.is_tensor(aux) or not (layer.training and torch.is_grad_enabled() and aux.requires_grad):
            return output
        return output if is_recomputing() else MoEAuxLossAutoScaler.apply(output, aux, scale)
    return hook


def register_routing_loss_hooks(layer: torch.nn.Module, scale: Callable[[], torch.Tensor]) -> None:
    """The routing losses of ``layer``'s MoE MLP reach the gradients weighted by ``scale()``: from the layer's
    output in the forward, from the MoE layer's in a reentrant checkpoint's rerun (a layer wrapped by hand in
    DeepSpeed's or torch's reentrant checkpoint routes under no_grad in the forward)."""
    layer.register_forward_hook(routing_loss_hook(scale))
    layer.mlp.register_forward_hook(reentrant_rerun_hook(scale))


class GPTModelChunk(torch.nn.Module):
    """One virtual stage: ``forward(tokens_or_hidden, labels=None, loss_mask=None)``.

    The first virtual stage takes token ids [b, s], the others the hidden states [s(/tp), b, h] of the
    stage before; the last returns the mean loss over the masked tokens, the others their hidden states.
    With multi-token prediction the last also holds the MTP layers (megatron-core's place for them) and
    copies of the word and position embeddings, and takes the micro-batch's ``tokens`` too
    (``takes_tokens``): depth k embeds the tokens k ahead.  ``packed_seq_params``: a packed micro-batch's documents
    (every chunk gets them; ``GPTModelChunks.packed_seq_params`` makes them once per micro-batch).
    """

    def __init__(self, config: GPTConfig, state: ParallelState, virtual_stage: int, num_virtual_stages: int,
                 layer_numbers: Sequence[int], tracker: Optional[MoEAuxLossTracker] = None):
        super().__init__()
        self.config, self.tp, self.cp = config, state.tp, state.cp
        self.virtual_stage = virtual_stage
        self.is_first = virtual_stage == 0
        self.is_last = virtual_stage == num_virtual_stages - 1
        self.layer_numbers = list(layer_numbers)  # global indices of self.layers
        self.layers = torch.nn.ModuleList()
        self.logits_buffer = LogitsBuffer() if self.is_last else None
        self.mtp = torch.nn.ModuleList() if self.is_last and config.mtp_num_layers else None
        self.takes_tokens = self.mtp is not None
        self.tracker = tracker
        self.weight_grad_store = None  # the zero-bubble schedule's: may defer the tied output layer's W

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        packed = packed_seq_params
        hidden = embed(self.word_embeddings, self.position_embeddings, inputs, packed) if self.is_first else inputs
        for layer in self.layers:
            hidden = layer(hidden, packed)
        if not self.is_last:
            return hidden
        hidden = self.final_layernorm(hidden)
        output_layer = self.output_layer if self.config.untie_embeddings_and_output_weights else None
        weight = self.word_embeddings.weight if output_layer is None else None
        loss = language_model_head(hidden, weight, output_layer, labels, loss_mask, self.config, self.tp, self.cp,
                                   self.logits_buffer, self.weight_grad_store, packed)
        if self.mtp is None or labels is None:
            return loss
        if tokens is None:
            raise ValueError("the last pipeline chunk of a model with mtp_num_layers needs the micro-batch's tokens")
        return loss + mtp_loss(self.mtp, self.word_embeddings, self.position_embeddings, tokens, labels, loss_mask,
                               hidden, output_layer, self.config, self.tp, self.cp, self.tracker,
                               self.weight_grad_store, packed)


class GPTModelChunks(torch.nn.Module):
    """This rank's chunks of the GPT of ``config`` (``chunks[c]`` is virtual stage ``c * p + rank``).

    ``num_model_chunks``: v (``virtual_pipeline_model_parallel_size``).  ``layers_per_stage`` /
    ``first_stage_layers`` / ``last_stage_layers``: ``pipeline_num_layers_per_stage`` (per virtual stage)
    and ``decoder_first/last_pipeline_num_layers``.
    """

    def __init__(self, config: GPTConfig, parallel_state: ParallelState,
                 rng_tracker: Optional[RNGStatesTracker] = None, *, num_model_chunks: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None):
        super().__init__()
        layout = parallel_state.layout
        config.check_layout(layout)
        p, rank, v = layout.pp, parallel_state.pp.rank, num_model_chunks
        if p == 1:
            raise ValueError("GPTModelChunks splits the model over pipeline ranks but the layout has pp=1; "
                             "use GPTModel")
        counts = stage_layer_counts(config.num_layers, p, "uniform", layers_per_stage, vpp=v,
                                    first=first_stage_layers, last=last_stage_layers)
        ranges = stage_layer_ranges(counts)
        self.config, self.rng_tracker, self.tp, self.cp = config, rng_tracker, parallel_state.tp, parallel_state.cp
        self.num_model_chunks = v
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, layout.tp)
        self.all_stage_layers = [rank_layers(counts, p, r) for r in range(p)]  # per pipeline rank, for convert
        self.stage_layers = self.all_stage_layers[rank]
        self.is_first_stage, self.is_last_stage = rank == 0, rank == p - 1
        # The routing losses and the multi-token-prediction loss, for the log (one tracker, as in GPTModel).
        self.moe_aux_loss_tracker = MoEAuxLossTracker() if config.num_experts or config.mtp_num_layers else None
        self._aux_loss_grad_scale: Optional[Callable[[], torch.Tensor]] = None
        self.chunks = torch.nn.ModuleList(
            GPTModelChunk(config, parallel_state, c * p + rank, p * v, ranges[c * p + rank], self.moe_aux_loss_tracker)
            for c in range(v))
        first, last = self.chunks[0].is_first, self.chunks[-1].is_last
        # The last stage's copies of the embedding: the tied output layer's, and multi-token prediction's (which
        # embeds tokens there); each summed with the first stage's over the embedding group, counted once in norms.
        mtp = bool(config.mtp_num_layers)
        copied = {"word_embeddings": mtp or not config.untie_embeddings_and_output_weights,
                  "position_embeddings": mtp}
        where = {i: chunk for chunk in self.chunks for i in chunk.layer_numbers}
        for name, module in build_gpt_modules(config, parallel_state, rng_tracker, self.moe_aux_loss_tracker):
            if name in copied:
                if first:
                    setattr(self.chunks[0], name, module)
                if last and copied[name]:
                    setattr(self.chunks[-1], name, module)
                for weight in module.parameters():  # the learned positions' (RoPE has none)
                    weight.shared_embedding = copied[name]
                    weight.shared = copied[name] and last
            elif name.startswith("layers.") and int(name.split(".")[1]) in where:
                where[int(name.split(".")[1])].layers.append(module)
                if isinstance(getattr(module, "mlp", None), BaseMoELayer):
                    register_routing_loss_hooks(module, self._routing_loss_scale)
            elif name in ("final_layernorm", "output_layer") and last:
                setattr(self.chunks[-1], name, module)
            elif name.startswith("mtp.") and last:
                self.chunks[-1].mtp.append(module)
                if isinstance(getattr(module.layer, "mlp", None), BaseMoELayer):
                    register_routing_loss_hooks(module.layer, self._routing_loss_scale)
            del module  # pieces of other stages are dropped as they come
        for chunk in self.chunks:  # recompute_method "block": the first layers of each chunk
            set_recompute_method(chunk.layers, config)

    def forward(self, *args, **kwargs):
        raise RuntimeError("GPTModelChunks is run by the pipeline runtime: call engine.train_batch(data_iter) / "
                           "engine.eval_batch(data_iter), as with DeepSpeed's pipeline engine")

    def packed_seq_params(self, tokens: torch.Tensor, documents: Dict[str, torch.Tensor]) -> Optional[PackedSeqParams]:
        """A micro-batch's documents (``position_ids`` / ``cu_seqlens`` / ``padding_mask``) as every chunk takes
        them; None for rows of one document each."""
        return PackedSeqParams.from_batch(tokens, self.cp, **documents)

    def set_aux_loss_gradient_scale(self, scale: Callable[[], torch.Tensor]) -> None:
        """What one unit of routing loss weighs in backward: loss scale / micro-batches (set by ``initialize``)."""
        self._aux_loss_grad_scale = scale

    def _routing_loss_scale(self):
        if self._aux_loss_grad_scale is None:
            raise RuntimeError("GPTModelChunks: the gradient scale of the MoE routing losses was never set; build "
                               "the engine with ds_megatron.initialize (or call set_aux_loss_gradient_scale)")
        return self._aux_loss_grad_scale()

    def gpt_name(self, name: str) -> str:
        """A parameter or submodule name here as ``GPTModel`` names it (``chunks.1.layers.0.mlp`` -> ``layers.5.mlp``)."""
        head, chunk, rest = name.split(".", 2)
        if head != "chunks":
            raise ValueError(f"{name!r} is not a GPTModelChunks name")
        if rest.startswith("layers."):
            _, local, tail = rest.split(".", 2)
            return f"layers.{self.chunks[int(chunk)].layer_numbers[int(local)]}.{tail}"
        return rest

    def named_gpt_parameters(self):
        """``(GPTModel name, param)`` of this rank's parameters (the last stage's tied copy included, once)."""
        for name, param in self.named_parameters():
            yield self.gpt_name(name), param

    def local_moe_layers(self) -> List[BaseMoELayer]:
        return [m for m in self.modules() if isinstance(m, BaseMoELayer)]


__all__ = ["GPTModelChunk", "GPTModelChunks", "register_routing_loss_hooks", "routing_loss_hook"]
