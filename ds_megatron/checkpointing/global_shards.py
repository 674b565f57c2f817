"""Where each of a rank's tensors lies in the whole model: layout-independent checkpoint names and offsets.

A rank's tensor (a name of ``convert.model_io.model_tensors``, its local shape)
is one or more ``GlobalShard``s: a row range of the local tensor placed at an
offset inside a tensor of the TP = EP = PP = 1 ``GPTModel``, under that model's
parameter name.  A checkpoint written as these shards (``torch.distributed.checkpoint``
stores every shard with its global offsets) is read back at any other layout: each
rank asks for its own shards and the reader cuts them out of whatever was saved.

The layouts (Megatron's, see ``transformer/attention.py``, ``transformer/mlp.py``,
``convert/mapping.py``):

* vocab rows: a rank's rows of the padded vocabulary; only the rows of the
  TP = 1 model's padded vocabulary are global (the rows a larger TP adds are zero, never read);
* ``query_key_value``: per query group ``[q heads, k, v]``, whole groups per rank, so a rank's
  rows are one block; with more TP ranks than groups, ``linear_q`` is a block of its group's q
  rows and ``linear_kv`` the group's ``[k, v]`` (the same block on each replica);
* fc1 with ``gated_linear_unit``: ``[gate rows of this rank; up rows of this rank]``, two
  blocks of the whole ``[gate; up]``; without it one block;
* multi-latent attention's up-projections (``q_proj`` / ``q_b_proj``, ``kv_b_proj``): whole heads, a block of rows;
* row-parallel weights (attention ``dense`` or ``o_proj``, fc2, the experts' fc2): a block of columns;
* the attention sinks (gpt-oss): the rank's heads, a block;
* experts: global expert index in the name, fc1 / fc2 split over the expert-tensor ranks (fc1's bias as fc1,
  fc2's a block of its hidden columns);
* everything else (norms, biases of row-parallel layers, position embeddings, the router,
  the shared-expert gate) whole on every rank that holds it.

Pure Python: names and shapes in, shards out.  ``tests/convert/test_global_shards.py``
puts the shards of every rank of many layouts together and compares with the
one-rank model built from the same seed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Tuple

from ..config.model import GPTConfig, pad_vocab_size

_EXPERT = re.compile(r"^((?:layers\.\d+|mtp\.\d+\.layer)\.mlp\.experts)\.(\d+)\.(linear_fc1|linear_fc2)\."
                     r"(weight|bias)$")
_ROW_PARALLEL = (".self_attention.dense.weight", ".self_attention.o_proj.weight", ".mlp.dense_4h_to_h.weight", ".shared_experts.dense_4h_to_h.weight")
# multi-latent attention's column-parallel up-projections: whole heads per rank, one block of rows
_MLA_UP = (".self_attention.q_proj.weight", ".self_attention.q_b_proj.weight", ".self_attention.kv_b_proj.weight")
_FC1 = (".mlp.dense_h_to_4h.weight", ".mlp.dense_h_to_4h.bias", ".shared_experts.dense_h_to_4h.weight",
        ".shared_experts.dense_h_to_4h.bias")


class GlobalLayoutError(ValueError):
    """A tensor this module does not know how to place in the whole model."""


@dataclass(frozen=True)
class GlobalShard:
    name: str  # the TP = EP = 1 GPTModel's parameter name
    global_shape: Tuple[int, ...]
    local_rows: Tuple[int, int]  # rows [start, stop) of the rank's tensor
    offsets: Tuple[int, ...]  # where those rows start in the global tensor


@dataclass(frozen=True)
class RankCoordinates:
    tp: int = 1
    tp_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    @classmethod
    def of(cls, parallel_state) -> "RankCoordinates":
        s = parallel_state
        return cls(s.tp.size, s.tp.rank, s.etp.size, s.etp.rank)


def _block(name, shape, parts, rank) -> List[GlobalShard]:
    """The rank's rows are block ``rank`` of ``parts`` along dim 0."""
    rows = shape[0]
    return [GlobalShard(name, (rows * parts,) + tuple(shape[1:]), (0, rows), (rank * rows,) + (0,) * (len(shape) - 1))]


def _gated(name, shape, parts, rank) -> List[GlobalShard]:
    """``[gate rows; up rows]`` of the rank: block ``rank`` of the gate half and of the up half."""
    half = shape[0] // 2
    full = half * parts
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    return [GlobalShard(name, (2 * full,) + rest, (0, half), (rank * half,) + zeros),
            GlobalShard(name, (2 * full,) + rest, (half, 2 * half), (full + rank * half,) + zeros)]


def _columns(name, shape, parts, rank) -> List[GlobalShard]:
    cols = shape[1]
    return [GlobalShard(name, (shape[0], cols * parts), (0, shape[0]), (0, rank * cols))]


def global_shards(config: GPTConfig, name: str, shape: Tuple[int, ...], tensor_parallel: bool,
                  rank: RankCoordinates) -> List[GlobalShard]:
    """The shards of a rank's tensor ``name`` (``model_tensors`` naming) of local ``shape``.

    ``tensor_parallel``: the parameter is marked as split over TP (its ``tensor_model_parallel``
    attribute); such a tensor under a name this function does not know is refused, never saved whole.
    """
    shape = tuple(shape)
    tp, t = rank.tp, rank.tp_rank
    expert = _EXPERT.match(name)
    if expert:
        prefix, e, which, kind = expert.groups()
        full = f"{prefix}.local_experts.{e}.{which}.{kind}"  # SequentialMLP's name in the one-rank model
        if which == "linear_fc2":  # its bias (gpt-oss) a block of the hidden columns (moe/experts.py)
            split = _columns if kind == "weight" else _block
            return split(full, shape, rank.etp, rank.etp_rank)
        split = _gated if config.gated_linear_unit else _block
        return split(full, shape, rank.etp, rank.etp_rank)
    if name in ("word_embeddings.weight", "output_layer.weight"):
        rows = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, 1)
        start = t * shape[0]
        if start >= rows:
            return []  # all padding of this TP size
        return [GlobalShard(name, (rows,) + shape[1:], (0, min(shape[0], rows - start)), (start, 0))]
    if name.endswith((".self_attention.query_key_value.weight", ".self_attention.query_key_value.bias")):
        return _block(name, shape, tp, t)
    replicated_kv = re.match(r"^(.*\.self_attention\.)(linear_q|linear_kv)\.(weight|bias)$", name)
    if replicated_kv:
        prefix, which, kind = replicated_kv.groups()
        d, g = config.head_dim, config.query_groups
        per_group = config.num_attention_heads // g
        group_rows = (per_group + 2) * d
        replicas = tp // g
        group, copy = divmod(t, replicas)
        start = group * group_rows + (copy * shape[0] if which == "linear_q" else per_group * d)
        return [GlobalShard(f"{prefix}query_key_value.{kind}", (g * group_rows,) + shape[1:], (0, shape[0]),
                            (start,) + (0,) * (len(shape) - 1))]
    if name.endswith(_MLA_UP) or name.endswith(".self_attention.sinks"):  # whole heads per rank
        return _block(name, shape, tp, t)
    if name.endswith(".eh_proj.weight"):  # multi-token prediction's column-parallel projection
        return _block(name, shape, tp, t)
    if name.endswith(_ROW_PARALLEL):
        return _columns(name, shape, tp, t)
    if name.endswith(_FC1):
        return (_gated if config.gated_linear_unit else _block)(name, shape, tp, t)
    if tensor_parallel and tp > 1:
        raise GlobalLayoutError(f"{name} is split over tensor-parallel ranks in a way the layout-independent "
                                "checkpoint does not know; save with megatron.train.ckpt_format \"deepspeed\"")
    return [GlobalShard(name, shape, (0, shape[0]) if shape else (0, 0), (0,) * len(shape))]
