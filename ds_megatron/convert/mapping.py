"""Which Hugging Face tensors, sliced how, make each tensor of each rank (pure Python, no torch).

A rank's tensor is a ``Target``: its name in our model (``GPTModel`` names, global
layer index; experts by global expert index), its shape, and its ``pieces``, rows
concatenated along dim 0, each a row range (and for row-parallel weights a column
range) of one Hugging Face tensor, or zeros (vocab padding).  Import builds each
target from its pieces; export puts every piece back where it came from.  Both
directions, and loading a rank's own shards in a training job, read this one table.

Our files, one per distinct set of tensors of a layout:

* ``model_pp{p}_tp{t}.safetensors``: every non-expert tensor of pipeline stage p on TP rank t;
* ``experts_pp{p}_ep{e}_etp{x}.safetensors``: the experts of stage p held by EP rank e, ETP rank x.

Sharding (Megatron's layouts, see ``transformer/attention.py`` and ``transformer/mlp.py``):
QKV per query group ``[q heads, k, v]``, groups split over TP (or, when TP exceeds
the groups, ``linear_q`` split and ``linear_kv`` the rank's group); multi-latent
attention's up-projections by whole heads, its down-projections and latent norms
whole; fc1 ``[gate; up]`` rows per rank; row-parallel weights by columns; the vocab
by rows, padded with zeros to the padded vocab; gpt-oss's attention sinks by heads; norms, the router (gpt-oss's
with its bias), its expert bias (a buffer: DeepSeek-V3's ``gate.e_score_correction_bias``) and the shared-expert
gate whole; experts' biases (gpt-oss) split over ETP, fc1's with its rows and fc2's by hidden columns.
gpt-oss's fused experts are named here per expert (``convert.fused_experts`` reads and writes the fused tensors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config.hf_config import MTP_FAMILIES
from ..config.model import GPTConfig, pad_vocab_size
from ..config.pipeline import stage_layer_counts, stage_layer_ranges
from ..errors import ConvertError

Range = Tuple[int, int]


@dataclass(frozen=True)
class Piece:
    source: Optional[str]  # a Hugging Face tensor name; None: zeros
    rows: Range  # rows of the source (of the zeros block: (0, n))
    cols: Optional[Range] = None  # columns of a 2-D source; None: all
    like: Optional[str] = None  # zeros: the tensor whose dtype they take

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(frozen=True)
class Target:
    name: str
    shape: Tuple[int, ...]
    pieces: Tuple[Piece, ...]


@dataclass(frozen=True)
class Layout:
    """A parallel layout of a converted model: sizes and the transformer layers of each pipeline stage."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    stage_layers: Tuple[Tuple[int, ...], ...] = ()

    @classmethod
    def uniform(cls, num_layers: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
                layers_per_stage: Optional[Sequence[int]] = None) -> "Layout":
        counts = stage_layer_counts(num_layers, pp, "uniform", layers_per_stage, None)
        return cls(tp, pp, ep, tp if etp is None else etp, tuple(tuple(r) for r in stage_layer_ranges(counts)))

    def to_json(self) -> Dict[str, object]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp,
                "stage_layers": [list(s) for s in self.stage_layers]}

    @classmethod
    def from_json(cls, d: Dict[str, object]) -> "Layout":
        return cls(d["tp"], d["pp"], d["ep"], d["etp"], tuple(tuple(s) for s in d["stage_layers"]))


def dense_file(stage: int, tp_rank: int) -> str:
    return f"model_pp{stage:03d}_tp{tp_rank:02d}.safetensors"


def expert_file(stage: int, ep_rank: int, etp_rank: int) -> str:
    return f"experts_pp{stage:03d}_ep{ep_rank:03d}_etp{etp_rank:02d}.safetensors"


class _Names:
    """The Hugging Face tensor names of a family."""

    def __init__(self, family: str):
        self.family = family

    def layer(self, i: int, rest: str) -> str:
        return f"model.layers.{i}.{rest}"

    def moe(self, i: int, rest: str) -> str:
        return self.layer(i, ("block_sparse_moe." if self.family == "mixtral" else "mlp.") + rest)

    def shared(self, i: int, rest: str) -> str:
        plural = self.family in ("deepseek_v3", "glm4_moe")
        return self.moe(i, ("shared_experts." if plural else "shared_expert.") + rest)

    def router(self, i: int, rest: str) -> str:
        return self.moe(i, ("router." if self.family == "gpt_oss" else "gate.") + rest)

    def expert(self, i: int, e: int, which: str, kind: str = "weight") -> str:
        """Expert e's ``which`` (gate, up, down) projection; gpt-oss's are the per-expert views of its fused
        tensors (``convert.fused_experts``)."""
        if self.family == "mixtral":
            return self.moe(i, f"experts.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[which]}.weight")
        return self.moe(i, f"experts.{e}.{which}_proj.{kind}")


def layer_name(config: GPTConfig, i: int) -> str:
    """Our name of transformer layer ``i``: ``layers.i``, or ``mtp.k.layer`` for the MTP layers after them."""
    return f"layers.{i}" if i < config.num_layers else f"mtp.{i - config.num_layers}.layer"


def _split(n: int, parts: int, rank: int) -> Range:
    size = n // parts
    return rank * size, (rank + 1) * size


def _rows(source: str, r: Range, cols: Optional[Range] = None) -> Piece:
    return Piece(source, r, cols)


class Mapping:
    """The ``Target``s of every file of ``layout`` for a model of ``family`` (see the module docstring)."""

    def __init__(self, family: str, config: GPTConfig, layout: Layout):
        self.family, self.config, self.layout = family, config, layout
        self.names = _Names(family)
        self.padded_vocab = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, layout.tp)
        self.mtp = config.mtp_num_layers or 0
        if self.mtp and family not in MTP_FAMILIES:
            raise ConvertError(f"model.mtp_num_layers={self.mtp}: {family} checkpoints have no multi-token-prediction "
                               f"layers ({', '.join(MTP_FAMILIES)}'s do); set mtp_num_layers to null to convert this "
                               "model")

    # -- Hugging Face side ---------------------------------------------------------------------------
    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every tensor the Hugging Face checkpoint holds, with its shape."""
        c, nm = self.config, self.names
        h, d, n, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups
        out: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
        if c.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = (c.vocab_size, h)
        for i in range(c.num_layers + self.mtp):  # the multi-token-prediction layers follow: model.layers.{L + k}
            att = lambda rest: nm.layer(i, "self_attn." + rest)  # noqa: E731
            out[nm.layer(i, "input_layernorm.weight")] = (h,)
            out[nm.layer(i, "post_attention_layernorm.weight")] = (h,)
            if c.post_sublayer_norms:  # Gemma: the MLP's input norm is pre_feedforward_layernorm
                out[nm.layer(i, "pre_feedforward_layernorm.weight")] = (h,)
                out[nm.layer(i, "post_feedforward_layernorm.weight")] = (h,)
            if c.multi_latent_attention:
                out.update({att(name): shape for name, shape in self._mla_shapes().items()})
            else:
                out.update({att("q_proj.weight"): (n * d, h), att("k_proj.weight"): (g * d, h),
                            att("v_proj.weight"): (g * d, h), att("o_proj.weight"): (h, n * d)})
                if c.qkv_bias:
                    out.update({att("q_proj.bias"): (n * d,), att("k_proj.bias"): (g * d,),
                                att("v_proj.bias"): (g * d,)})
                if c.add_bias_linear:
                    out[att("o_proj.bias")] = (h,)
            if c.qk_layernorm:
                out.update({att("q_norm.weight"): (d,), att("k_norm.weight"): (d,)})
            if c.softmax_type == "learnable":
                out[att("sinks")] = (n,)
            if c.is_moe_layer(i):
                f = c.moe_ffn_hidden_size
                out[nm.router(i, "weight")] = (c.num_experts, h)
                if c.moe_add_bias_linear:
                    out[nm.router(i, "bias")] = (c.num_experts,)
                if c.moe_router_enable_expert_bias:
                    out[nm.moe(i, "gate.e_score_correction_bias")] = (c.num_experts,)
                for e in range(c.num_experts):
                    out.update({nm.expert(i, e, "gate"): (f, h), nm.expert(i, e, "up"): (f, h),
                                nm.expert(i, e, "down"): (h, f)})
                    if c.moe_add_bias_linear:
                        out.update({nm.expert(i, e, "gate", "bias"): (f,), nm.expert(i, e, "up", "bias"): (f,),
                                    nm.expert(i, e, "down", "bias"): (h,)})
                if c.moe_shared_expert_intermediate_size:
                    s = c.moe_shared_expert_intermediate_size
                    out.update({nm.shared(i, "gate_proj.weight"): (s, h), nm.shared(i, "up_proj.weight"): (s, h),
                                nm.shared(i, "down_proj.weight"): (h, s)})
                    if c.moe_shared_expert_gate:
                        out[nm.moe(i, "shared_expert_gate.weight")] = (1, h)
            else:
                f = c.ffn_hidden_size
                out.update({nm.layer(i, "mlp.gate_proj.weight"): (f, h), nm.layer(i, "mlp.up_proj.weight"): (f, h),
                            nm.layer(i, "mlp.down_proj.weight"): (h, f)})
                if c.add_bias_linear:
                    out.update({nm.layer(i, "mlp.gate_proj.bias"): (f,), nm.layer(i, "mlp.up_proj.bias"): (f,),
                                nm.layer(i, "mlp.down_proj.bias"): (h,)})
        for k in range(self.mtp):
            i = c.num_layers + k
            out.update({nm.layer(i, "enorm.weight"): (h,), nm.layer(i, "hnorm.weight"): (h,),
                        nm.layer(i, "eh_proj.weight"): (h, 2 * h), nm.layer(i, "shared_head.norm.weight"): (h,)})
        out.update({copy: (c.vocab_size, h) for copy in self.hf_copies()})
        return out

    def hf_copies(self) -> Dict[str, str]:
        """Hugging Face tensors that repeat another: DeepSeek-V3's (and GLM-4.5's) MTP layers carry the embedding and
        the output head they share with the main model.  Export writes them from the original (when the source had
        them: GLM-4.6's lack them); import checks they equal it."""
        c, nm = self.config, self.names
        head = "lm_head.weight" if c.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
        out = {}
        for k in range(self.mtp):
            out[nm.layer(c.num_layers + k, "embed_tokens.weight")] = "model.embed_tokens.weight"
            out[nm.layer(c.num_layers + k, "shared_head.head.weight")] = head
        return out

    def _mla_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Multi-latent attention's tensors (transformers' DeepSeek-V3 names under ``self_attn.``) with shapes."""
        c = self.config
        h, n, pos = c.hidden_size, c.num_attention_heads, c.qk_pos_emb_head_dim
        q_rows = n * (c.qk_head_dim + pos)
        out: Dict[str, Tuple[int, ...]] = {}
        if c.q_lora_rank is None:
            out["q_proj.weight"] = (q_rows, h)
        else:
            out.update({"q_a_proj.weight": (c.q_lora_rank, h), "q_a_layernorm.weight": (c.q_lora_rank,),
                        "q_b_proj.weight": (q_rows, c.q_lora_rank)})
        out.update({"kv_a_proj_with_mqa.weight": (c.kv_lora_rank + pos, h), "kv_a_layernorm.weight": (c.kv_lora_rank,),
                    "kv_b_proj.weight": (n * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank),
                    "o_proj.weight": (h, n * c.v_head_dim)})
        if c.add_bias_linear:  # attention_bias: the down-projections and o_proj
            if c.q_lora_rank is not None:
                out["q_a_proj.bias"] = (c.q_lora_rank,)
            out.update({"kv_a_proj_with_mqa.bias": (c.kv_lora_rank + pos,), "o_proj.bias": (h,)})
        return out

    # -- our side ------------------------------------------------------------------------------------
    def files(self) -> Dict[str, List[Target]]:
        """Every file of the layout with its targets (dense files first, then expert files)."""
        lay, c = self.layout, self.config
        out = {dense_file(p, t): self.dense_targets(p, t) for p in range(lay.pp) for t in range(lay.tp)}
        if c.num_experts:
            for p in range(lay.pp):
                for e in range(lay.ep):
                    for x in range(lay.etp):
                        out[expert_file(p, e, x)] = self.expert_targets(p, e, x)
        return out

    def _vocab(self, name: str, source: str, t: int) -> Target:
        c = self.config
        a, b = _split(self.padded_vocab, self.layout.tp, t)
        pieces = []
        if a < c.vocab_size:
            pieces.append(_rows(source, (a, min(b, c.vocab_size))))
        if b > c.vocab_size:
            pieces.append(Piece(None, (0, b - max(a, c.vocab_size)), like=source))
        return Target(name, (b - a, c.hidden_size), tuple(pieces))

    def _column(self, name: str, sources: Sequence[str], width: int, parts: int, rank: int, inner: int,
                bias: bool = False) -> Target:
        """``[s_0 rows of this rank; s_1 rows of this rank; ...]`` (fc1 ``[gate; up]``: sources gate, up)."""
        r = _split(width, parts, rank)
        shape = (len(sources) * (r[1] - r[0]),) + (() if bias else (inner,))
        return Target(name, shape, tuple(_rows(s, r) for s in sources))

    def _row_parallel(self, name: str, source: str, out_rows: int, width: int, parts: int, rank: int) -> Target:
        cols = _split(width, parts, rank)
        return Target(name, (out_rows, cols[1] - cols[0]), (_rows(source, (0, out_rows), cols),))

    @staticmethod
    def _whole(name: str, source: str, shape: Tuple[int, ...]) -> Target:
        return Target(name, shape, (_rows(source, (0, shape[0])),))

    def _mla(self, i: int, t: int, ours: str) -> List[Target]:
        """Multi-latent attention: the up-projections by whole heads (a block of rows), ``o_proj`` by columns,
        the down-projections, latent norms and biases whole (``transformer/multi_latent_attention.py``)."""
        tp = self.layout.tp
        ours += ".self_attention."
        out = []
        for name, shape in self._mla_shapes().items():
            source = self.names.layer(i, "self_attn." + name)
            if name in ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight"):
                out.append(self._column(ours + name, (source,), shape[0], tp, t, shape[1]))
            elif name == "o_proj.weight":
                out.append(self._row_parallel(ours + name, source, shape[0], shape[1], tp, t))
            else:
                out.append(self._whole(ours + name, source, shape))
        return out

    def _attention(self, i: int, t: int, ours: str) -> List[Target]:
        c, nm, tp = self.config, self.names, self.layout.tp
        if c.multi_latent_attention:
            return self._mla(i, t, ours)
        h, d, n, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups
        qpg = n // g
        ours += ".self_attention."
        att = lambda rest: nm.layer(i, "self_attn." + rest)  # noqa: E731
        out = []
        kinds = [("weight", False)] + ([("bias", True)] if c.qkv_bias else [])
        for kind, is_bias in kinds:
            q, k, v = (att(f"{x}_proj.{kind}") for x in "qkv")
            inner = () if is_bias else (h,)
            if tp <= g:
                pieces = []
                for grp in range(*_split(g, tp, t)):
                    pieces += [_rows(q, (grp * qpg * d, (grp + 1) * qpg * d)), _rows(k, (grp * d, (grp + 1) * d)),
                               _rows(v, (grp * d, (grp + 1) * d))]
                rows = sum(p.num_rows for p in pieces)
                out.append(Target(ours + f"query_key_value.{kind}", (rows,) + inner, tuple(pieces)))
            else:
                grp = t // (tp // g)
                qr = _split(n * d, tp, t)
                out.append(Target(ours + f"linear_q.{kind}", (qr[1] - qr[0],) + inner, (_rows(q, qr),)))
                out.append(Target(ours + f"linear_kv.{kind}", (2 * d,) + inner,
                                  (_rows(k, (grp * d, (grp + 1) * d)), _rows(v, (grp * d, (grp + 1) * d)))))
        if c.qk_layernorm:
            out += [self._whole(ours + "q_layernorm.weight", att("q_norm.weight"), (d,)),
                    self._whole(ours + "k_layernorm.weight", att("k_norm.weight"), (d,))]
        if c.softmax_type == "learnable":  # the sinks of this rank's heads
            out.append(self._column(ours + "sinks", (att("sinks"),), n, tp, t, 0, bias=True))
        out.append(self._row_parallel(ours + "dense.weight", att("o_proj.weight"), h, n * d, tp, t))
        if c.add_bias_linear:
            out.append(self._whole(ours + "dense.bias", att("o_proj.bias"), (h,)))
        return out

    def _mlp(self, ours: str, gate: str, up: str, down: str, width: int, t: int, biases: Optional[Tuple[str, ...]]):
        c, tp, h = self.config, self.layout.tp, self.config.hidden_size
        out = [self._column(ours + "dense_h_to_4h.weight", (gate, up), width, tp, t, h),
               self._row_parallel(ours + "dense_4h_to_h.weight", down, h, width, tp, t)]
        if biases:
            out += [self._column(ours + "dense_h_to_4h.bias", biases[:2], width, tp, t, h, bias=True),
                    self._whole(ours + "dense_4h_to_h.bias", biases[2], (h,))]
        return out

    def _layer(self, i: int, t: int) -> List[Target]:
        """Transformer layer ``i``'s dense tensors (``i`` >= num_layers: multi-token prediction's)."""
        c, nm, h = self.config, self.names, self.config.hidden_size
        layer = layer_name(c, i)
        out = [self._whole(f"{layer}.input_layernorm.weight", nm.layer(i, "input_layernorm.weight"), (h,))]
        out += self._attention(i, t, layer)
        if c.post_sublayer_norms:
            # Gemma's post_attention_layernorm normalizes the attention's output; our post_attention_layernorm
            # (Megatron's name) is the MLP's input norm, its pre_feedforward_layernorm
            out += [self._whole(f"{layer}.post_self_attn_layernorm.weight",
                                nm.layer(i, "post_attention_layernorm.weight"), (h,)),
                    self._whole(f"{layer}.post_attention_layernorm.weight",
                                nm.layer(i, "pre_feedforward_layernorm.weight"), (h,))]
        else:
            out.append(self._whole(f"{layer}.post_attention_layernorm.weight",
                                   nm.layer(i, "post_attention_layernorm.weight"), (h,)))
        if c.is_moe_layer(i):
            ours = f"{layer}.mlp."
            out.append(self._whole(ours + "router.weight", nm.router(i, "weight"), (c.num_experts, h)))
            if c.moe_add_bias_linear:
                out.append(self._whole(ours + "router.bias", nm.router(i, "bias"), (c.num_experts,)))
            if c.moe_router_enable_expert_bias:  # the router's fp32 buffer, whole on every rank of the stage
                out.append(self._whole(ours + "router.expert_bias", nm.moe(i, "gate.e_score_correction_bias"),
                                       (c.num_experts,)))
            if c.moe_shared_expert_intermediate_size:
                out += self._mlp(ours + "shared_experts.", nm.shared(i, "gate_proj.weight"),
                                 nm.shared(i, "up_proj.weight"), nm.shared(i, "down_proj.weight"),
                                 c.moe_shared_expert_intermediate_size, t, None)
                if c.moe_shared_expert_gate:
                    out.append(self._whole(ours + "shared_experts.gate_weight",
                                           nm.moe(i, "shared_expert_gate.weight"), (1, h)))
        else:
            mlp = lambda rest: nm.layer(i, "mlp." + rest)  # noqa: E731
            biases = tuple(mlp(f"{x}_proj.bias") for x in ("gate", "up", "down")) if c.add_bias_linear else None
            out += self._mlp(f"{layer}.mlp.", mlp("gate_proj.weight"), mlp("up_proj.weight"),
                             mlp("down_proj.weight"), c.ffn_hidden_size, t, biases)
        if c.post_sublayer_norms:
            out.append(self._whole(f"{layer}.post_mlp_layernorm.weight",
                                   nm.layer(i, "post_feedforward_layernorm.weight"), (h,)))
        return out

    def _mtp(self, k: int, t: int) -> List[Target]:
        """Multi-token-prediction depth k: its norms, ``eh_proj`` (column-parallel) and transformer layer."""
        c, nm, h = self.config, self.names, self.config.hidden_size
        i, ours = c.num_layers + k, f"mtp.{k}."
        return ([self._whole(ours + "enorm.weight", nm.layer(i, "enorm.weight"), (h,)),
                 self._whole(ours + "hnorm.weight", nm.layer(i, "hnorm.weight"), (h,)),
                 self._column(ours + "eh_proj.weight", (nm.layer(i, "eh_proj.weight"),), h, self.layout.tp, t, 2 * h)]
                + self._layer(i, t)
                + [self._whole(ours + "final_layernorm.weight", nm.layer(i, "shared_head.norm.weight"), (h,))])

    def dense_targets(self, stage: int, t: int) -> List[Target]:
        c, lay = self.config, self.layout
        h = c.hidden_size
        first, last = stage == 0, stage == lay.pp - 1
        out: List[Target] = []
        # the last stage's copy: the tied output layer's, or multi-token prediction's (which embeds tokens there)
        if first or (last and (self.mtp or not c.untie_embeddings_and_output_weights)):
            out.append(self._vocab("word_embeddings.weight", "model.embed_tokens.weight", t))
        for i in lay.stage_layers[stage]:
            out += self._layer(i, t)
        if last:
            out.append(self._whole("final_layernorm.weight", "model.norm.weight", (h,)))
            if c.untie_embeddings_and_output_weights:
                out.append(self._vocab("output_layer.weight", "lm_head.weight", t))
            for k in range(self.mtp):
                out += self._mtp(k, t)
        return out

    def expert_targets(self, stage: int, ep_rank: int, etp_rank: int) -> List[Target]:
        c, nm, lay = self.config, self.names, self.layout
        h, f = c.hidden_size, c.moe_ffn_hidden_size
        per_rank = c.num_experts // lay.ep
        out: List[Target] = []
        mtp = range(c.num_layers, c.num_layers + self.mtp) if stage == lay.pp - 1 else range(0)
        for i in list(lay.stage_layers[stage]) + list(mtp):
            if not c.is_moe_layer(i):
                continue
            for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank):
                ours = f"{layer_name(c, i)}.mlp.experts.{e}."
                out.append(self._column(ours + "linear_fc1.weight", (nm.expert(i, e, "gate"), nm.expert(i, e, "up")),
                                        f, lay.etp, etp_rank, h))
                out.append(self._row_parallel(ours + "linear_fc2.weight", nm.expert(i, e, "down"), h, f, lay.etp,
                                              etp_rank))
                if c.moe_add_bias_linear:  # fc1's with its rows, fc2's by hidden columns (moe/experts.py)
                    out += [self._column(ours + "linear_fc1.bias", (nm.expert(i, e, "gate", "bias"),
                                                                    nm.expert(i, e, "up", "bias")), f, lay.etp,
                                         etp_rank, 0, bias=True),
                            self._column(ours + "linear_fc2.bias", (nm.expert(i, e, "down", "bias"),), h, lay.etp,
                                         etp_rank, 0, bias=True)]
        return out
