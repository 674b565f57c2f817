"""gpt-oss's fused expert tensors as the per-expert tensors the mapping names, both ways.

transformers stores a gpt-oss layer's experts fused under ``model.layers.{i}.mlp.experts.``: ``gate_up_proj
[E, h, 2f]`` (the ``x @ W`` layout, gate and up interleaved along the last dim: ``[..., 0::2]`` gate,
``[..., 1::2]`` up), ``gate_up_proj_bias [E, 2f]`` (interleaved alike), ``down_proj [E, f, h]`` and ``down_proj_bias
[E, h]``.  The released checkpoints hold the two weights in MXFP4 instead: ``{proj}_blocks [E, rows, cols / 32, 16]``
uint8 (two 4-bit codes of ``FP4_VALUES`` a byte, the low nibble first) and ``{proj}_scales [E, rows, cols / 32]``
uint8 (power-of-two exponents biased by 127), ``rows x cols`` the weight transposed (``[2f, h]``, ``[h, f]``).

The mapping names expert e's projections ``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`` (``[out, in]``
weights).  ``FusedExperts(table)`` is a source's table under those names (``table``) and reads them (``read``),
MXFP4 dequantized into the dtype of the experts' biases (the model's) with transformers' arithmetic
(``_convert_moe_packed_tensors``: code value x 2^(scale - 127) in that dtype).  ``fused_shapes`` and ``fuse`` make
the fused tensors back for export, in the per-expert tensors' dtype (never MXFP4).
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import ConvertError
from .safetensors_io import SliceReader

Entry = Tuple[str, torch.dtype, Tuple[int, ...]]  # a table's (path, dtype, shape)

# The E2M1 values of the 16 codes (sign bit 3), as transformers' integrations/mxfp4.py lists them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` -> ``[..., G * 32]`` in ``dtype`` (not transposed)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = lut[codes]
    return torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1)).flatten(-2)


class FusedExperts:
    """A Hugging Face table (``name -> (path, dtype, shape)``) with gpt-oss's fused experts as per-expert tensors."""

    def __init__(self, table: Dict[str, Entry]):
        self.table: Dict[str, Entry] = {}
        self.views: Dict[str, Tuple[str, str, int, str, str]] = {}  # name -> (prefix, proj, e, which, kind)
        self.raw = table
        self.quantized: set = set()  # the fused names held in MXFP4
        fused: Dict[Tuple[str, str], Dict[str, Entry]] = {}
        for name, entry in table.items():
            m = _FUSED.match(name)
            if m is None:
                self.table[name] = entry
            else:
                fused.setdefault((m.group(1), m.group(2)), {})[m.group(3) or ""] = entry
        for (prefix, proj), parts in sorted(fused.items()):
            self._add(prefix, proj, parts)
        self._cache: Tuple[Optional[Tuple], Optional[torch.Tensor]] = (None, None)

    def _add(self, prefix: str, proj: str, parts: Dict[str, Entry]) -> None:
        name = prefix + proj
        if "_bias" not in parts:
            raise ConvertError(f"tensor {name}_bias is missing from the checkpoint's files (gpt-oss's experts are "
                               "biased); complete the checkpoint")
        path, bias_dtype, bias_shape = parts["_bias"]
        quantized = "_blocks" in parts or "_scales" in parts
        if quantized:
            if "" in parts or "_blocks" not in parts or "_scales" not in parts:
                raise ConvertError(f"{path}: {name} needs exactly {name}_blocks and {name}_scales (MXFP4) or {name}; "
                                   f"the files hold {sorted(name + k for k in parts)}")
            blocks, scales = parts["_blocks"][2], parts["_scales"][2]
            if len(blocks) != 4 or blocks[-1] != 16 or scales != blocks[:-1]:
                raise ConvertError(f"{parts['_blocks'][0]}: {name}_blocks {list(blocks)} and {name}_scales "
                                   f"{list(scales)} are not MXFP4's [E, rows, groups, 16] and [E, rows, groups]")
            shape = (blocks[0], blocks[2] * 32, blocks[1])  # the dequantized weight, transposed as transformers'
            dtype = bias_dtype  # the model's dtype
        else:
            if "" not in parts:
                raise ConvertError(f"tensor {name} is missing from the checkpoint's files; complete the checkpoint")
            path, dtype, shape = parts[""]
            if len(shape) != 3:
                raise ConvertError(f"{path}: tensor {name} has shape {list(shape)}; gpt-oss's is [experts, in, out]")
        experts, fan_in, fan_out = shape
        if tuple(bias_shape) != (experts, fan_out):
            raise ConvertError(f"{path}: tensor {name}_bias has shape {list(bias_shape)}, not [{experts}, {fan_out}] "
                               f"as {name} implies")
        halves = ("gate", "up") if proj == "gate_up_proj" else ("down",)
        rows = fan_out // len(halves)
        for e in range(experts):
            for which in halves:
                for kind, dt, sub in (("weight", dtype, (rows, fan_in)), ("bias", bias_dtype, (rows,))):
                    view = f"{prefix}{e}.{which}_proj.{kind}"
                    self.table[view] = (path, dt, sub)
                    self.views[view] = (prefix, proj, e, which, kind)
        if quantized:
            self.quantized.add(name)

    def is_view(self, name: str) -> bool:
        return name in self.views

    def _expert(self, reader: SliceReader, prefix: str, proj: str, e: int, kind: str, dtype: torch.dtype):
        """Expert e's fused ``proj`` weight as ``[out, in]`` (gate and up still interleaved) or bias ``[out]``."""
        key = (prefix, proj, e, kind)
        if self._cache[0] == key:
            return self._cache[1]
        name = prefix + proj
        if kind == "bias":
            out = reader.read(self.raw[name + "_bias"][0], name + "_bias", (e, e + 1))[0]
        elif name in self.quantized:
            blocks = reader.read(self.raw[name + "_blocks"][0], name + "_blocks", (e, e + 1))[0]
            scales = reader.read(self.raw[name + "_scales"][0], name + "_scales", (e, e + 1))[0]
            out = dequantize_mxfp4(blocks, scales, dtype)  # [out, in]: the blocks are the weight transposed
        else:
            out = reader.read(self.raw[name][0], name, (e, e + 1))[0].t()
        self._cache = (key, out)
        return out

    def read(self, reader: SliceReader, name: str, rows: Optional[Tuple[int, int]] = None,
             cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Rows (and columns) of per-expert tensor ``name``."""
        prefix, proj, e, which, kind = self.views[name]
        full = self._expert(reader, prefix, proj, e, kind, self.table[name][1])
        if proj == "gate_up_proj":
            full = full[0::2] if which == "gate" else full[1::2]
        if rows is not None:
            full = full[rows[0]:rows[1]]
        if cols is not None:
            full = full[:, cols[0]:cols[1]]
        return full.contiguous()


def fused_shapes(shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Tuple[Tuple[int, ...], List[str]]]:
    """The fused tensors export writes for the per-expert ones among ``shapes``: ``name -> (shape, parts)``."""
    out: Dict[str, Tuple[Tuple[int, ...], List[str]]] = {}
    counts: Dict[str, int] = {}
    for name in shapes:
        m = _EXPERT.match(name)
        if m:
            counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
    for prefix, experts in counts.items():
        f, h = shapes[f"{prefix}0.gate_proj.weight"]
        parts = {kind: [f"{prefix}{e}.{w}_proj.{kind}" for e in range(experts) for w in ("gate", "up")]
                 for kind in ("weight", "bias")}
        out[prefix + "gate_up_proj"] = ((experts, h, 2 * f), parts["weight"])
        out[prefix + "gate_up_proj_bias"] = ((experts, 2 * f), parts["bias"])
        out[prefix + "down_proj"] = ((experts, f, h), [f"{prefix}{e}.down_proj.weight" for e in range(experts)])
        out[prefix + "down_proj_bias"] = ((experts, h), [f"{prefix}{e}.down_proj.bias" for e in range(experts)])
    return out


def fuse(name: str, shape: Tuple[int, ...], parts: List[str], get: Callable[[str], torch.Tensor],
         dtype: torch.dtype) -> torch.Tensor:
    """Fused tensor ``name`` (of ``fused_shapes``) from its per-expert ``parts`` (``get`` returns each)."""
    out = torch.empty(shape, dtype=dtype)
    if name.endswith("gate_up_proj") or name.endswith("gate_up_proj_bias"):
        for i, part in enumerate(parts):
            e, up = divmod(i, 2)  # gate then up of each expert
            block = get(part).to(dtype)
            if block.dim() == 2:
                out[e][:, up::2] = block.t()
            else:
                out[e][up::2] = block
    else:
        for e, part in enumerate(parts):
            block = get(part).to(dtype)
            out[e] = block.t() if block.dim() == 2 else block
    return out
