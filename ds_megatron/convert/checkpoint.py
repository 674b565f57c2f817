"""Hugging Face <-> our layout, as whole directories: validate everything first, then stream, then rename.

``convert(src, dst, tp, pp, ep, etp)``: the direction follows from ``src`` (a Hugging
Face directory has ``config.json``; ours has ``ds_megatron_checkpoint.json``).
Every name, shape and file is checked from the headers before a byte is
written; the output goes to a temporary directory next to ``dst`` that is
renamed to ``dst`` at the end, so a failure leaves nothing behind and never
touches an existing directory; its files and directories get the modes the
umask gives (not ``mkdtemp``'s 0700, not the source files' own).  Peak memory
is one target tensor (import: read through ``get_slice``, only the rows and
columns it needs) or one Hugging Face tensor (export).

Our directory: ``ds_megatron_checkpoint.json`` (family, model section, layout,
the original ``config.json``, the Hugging Face dtypes and tensor order), the
rank files of ``mapping.files()``, and ``hf_files/`` (tokenizer and generation
files carried through unchanged).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..config.hf_config import METADATA, hf_from_model, model_from_hf, resolve_mtp
from ..config.model import GPTConfig
from ..errors import ConfigError, ConvertError
from .fused_experts import FusedExperts, fuse, fused_shapes
from .mapping import Layout, Mapping, Target
from .safetensors_io import (DTYPES, TORCH_DTYPES, SliceReader, StreamingWriter, hf_weight_files, read_header,
                             tensor_table)

HF_FILES = "hf_files"
_WEIGHT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")
# Buffers some older checkpoints carry; recomputed, never weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def is_our_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


class HFSource:
    """A validated Hugging Face directory: its config mapped to ours and its tensor table (headers only).

    ``mtp_num_layers``: the multi-token-prediction layers to load (``config.hf_config.resolve_mtp``: None, those the
    files hold; 0, none); ``notice`` the line saying that declared layers are absent and left off."""

    def __init__(self, hf_dir: str, mtp_num_layers: Optional[int] = None):
        self.dir = hf_dir
        path = os.path.join(hf_dir, "config.json")
        try:
            with open(path) as f:
                self.hf_config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{path}: cannot read it ({e})") from None
        try:
            self.family, self.model = model_from_hf(self.hf_config)
        except ConvertError as e:
            raise ConvertError(f"{hf_dir}/{e}") from None
        self.table = tensor_table(hf_weight_files(hf_dir))
        # gpt-oss: its fused (or MXFP4) experts as the per-expert tensors the mapping names
        self.fused = None
        if self.family == "gpt_oss":
            try:
                self.fused = FusedExperts(self.table)
            except ConvertError as e:
                raise ConvertError(f"{hf_dir}: {e}") from None
            self.table = self.fused.table
        self.declared_mtp = self.model.get("mtp_num_layers") or 0
        self.notice = resolve_mtp(self.model, set(self.table), mtp_num_layers, hf_dir)

    def gpt_config(self, **overrides) -> GPTConfig:
        return GPTConfig(**{**self.model, **overrides})

    def validate(self, mapping: Mapping) -> None:
        """Every tensor the config implies is there with its shape, and nothing else is."""
        expected = mapping.hf_shapes()
        copies = mapping.hf_copies()
        # MTP layers left off (mtp_num_layers 0) that the files hold: not read
        skipped = tuple(f"model.layers.{mapping.config.num_layers + k}." for k in range(mapping.mtp, self.declared_mtp))
        for name, shape in expected.items():
            if name in copies and name not in self.table:
                continue  # GLM-4.6's MTP layers lack the copies of the embedding and head
            if name not in self.table:
                mtp = mapping.mtp and name.startswith(tuple(f"model.layers.{mapping.config.num_layers + k}."
                                                            for k in range(mapping.mtp)))
                hint = (f" (config.json asks for {mapping.mtp} multi-token-prediction layer(s) and the files hold "
                        "only some of their tensors: complete the checkpoint, or load it with mtp_num_layers 0)"
                        if mtp else "")
                raise ConvertError(f"{self.dir}: tensor {name} is missing from the checkpoint's files{hint}")
            path, _, found = self.table[name]
            if found != shape:
                raise ConvertError(f"{path}: tensor {name} has shape {list(found)} but config.json implies "
                                   f"{list(shape)}")
        for name, (path, _, _) in self.table.items():
            if name not in expected and not name.endswith(_IGNORED_SUFFIXES) and not (skipped and
                                                                                     name.startswith(skipped)):
                raise ConvertError(f"{path}: unexpected tensor {name} (not part of a {self.family} model with this "
                                   "config.json); convert the model it belongs to")

    def check_copies(self, mapping: Mapping, reader: SliceReader, rows: Optional[Tuple[int, int]] = None) -> None:
        """The tensors that repeat another (``Mapping.hf_copies``) equal it (in ``rows`` only, when given: a
        rank's vocab shard); our model keeps one weight for both, so a copy that differs is refused, not dropped."""
        for copy, original in mapping.hf_copies().items():
            if copy not in self.table:
                continue
            r = rows or (0, self.table[original][2][0])
            if not torch.equal(self.read(reader, copy, r), self.read(reader, original, r)):
                raise ConvertError(f"{self.table[copy][0]}: tensor {copy} differs from {original}, which ds_megatron's "
                                   "multi-token-prediction layer shares with the main model; make them equal")

    def read(self, reader: SliceReader, name: str, rows: Optional[Tuple[int, int]] = None,
             cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Rows (and columns) of Hugging Face tensor ``name`` (gpt-oss's per-expert views included)."""
        if self.fused is not None and self.fused.is_view(name):
            return self.fused.read(reader, name, rows, cols)
        return reader.read(self.table[name][0], name, rows, cols)

    def dtype_of(self, target: Target) -> torch.dtype:
        dtypes = {self.table[p.source or p.like][1] for p in target.pieces}
        if len(dtypes) != 1:
            raise ConvertError(f"{self.dir}: the tensors making {target.name} have dtypes {sorted(map(str, dtypes))}; "
                               "they must share one")
        return dtypes.pop()

    def build(self, target: Target, reader: SliceReader, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``target`` from its pieces (only their rows and columns are read)."""
        dtype = dtype or self.dtype_of(target)
        blocks = []
        for p in target.pieces:
            if p.source is None:
                blocks.append(torch.zeros((p.num_rows,) + tuple(target.shape[1:]), dtype=dtype))
            else:
                blocks.append(self.read(reader, p.source, p.rows, p.cols).to(dtype))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _fresh_destination(dst: str) -> str:
    """A temporary directory next to ``dst`` (renamed to it at the end); ``dst`` must not exist yet."""
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ConvertError(f"{dst}: the destination exists; choose a new directory (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    # A unique name made by mkdir, not tempfile.mkdtemp: mkdtemp's 0700 would be dst's mode after the rename, where
    # mkdir's follows the umask like every file written into it (readable by an inference server's user).
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


def _finish(tmp: str, dst: str) -> None:
    if os.path.isdir(dst):
        os.rmdir(dst)  # empty (checked at start)
    os.rename(tmp, dst)


def _extra_files(src: str) -> List[str]:
    return sorted(f for f in os.listdir(src) if os.path.isfile(os.path.join(src, f))
                  and f not in _WEIGHT_FILES and not f.endswith(".safetensors") and f != METADATA)


def extra_files(directory: str) -> Dict[str, bytes]:
    """The non-weight files (tokenizer, generation config) of a Hugging Face directory or of our ``hf_files/``."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for f in _extra_files(directory):
        with open(os.path.join(directory, f), "rb") as fh:
            out[f] = fh.read()
    return out


def hf_to_ours(src: str, dst: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
               overrides: Optional[Dict] = None) -> str:
    """Import: Hugging Face directory ``src`` -> our directory ``dst`` at layout (tp, pp, ep, etp)."""
    source = HFSource(src)
    if source.notice:
        print(source.notice)
    config = source.gpt_config(**(overrides or {}))
    layout = Layout.uniform(config.num_layers, tp, pp, ep, etp)
    check_layout(config, layout)
    mapping = Mapping(source.family, config, layout)
    source.validate(mapping)
    files = mapping.files()
    plans = {name: [(t, source.dtype_of(t)) for t in targets] for name, targets in files.items()}
    tmp = _fresh_destination(dst)
    try:
        reader = SliceReader()
        source.check_copies(mapping, reader)
        for fname, targets in plans.items():
            writer = StreamingWriter(os.path.join(tmp, fname), [(t.name, dt, t.shape) for t, dt in targets],
                                     {"format": "pt"})
            for target, dtype in targets:
                writer.write(target.name, source.build(target, reader, dtype))
            writer.close()
        reader.close()
        extra = _extra_files(src)
        if extra:
            os.makedirs(os.path.join(tmp, HF_FILES))
            for f in extra:
                shutil.copyfile(os.path.join(src, f), os.path.join(tmp, HF_FILES, f))
        write_metadata(tmp, source.family, config, layout, source.hf_config,
                       {n: DTYPES[dt] for n, (_, dt, _) in sorted(source.table.items())
                        if not n.endswith(_IGNORED_SUFFIXES)})
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def write_metadata(directory: str, family: str, config: GPTConfig, layout: Layout, hf_config: Dict,
                   hf_dtypes: Dict[str, str]) -> None:
    meta = {"format": "ds_megatron", "version": 1, "family": family, "model": asdict(config),
            "layout": layout.to_json(), "hf_config": hf_config, "hf_dtypes": hf_dtypes}
    with open(os.path.join(directory, METADATA), "w") as f:
        json.dump(meta, f, indent=1)


def check_layout(config: GPTConfig, layout: Layout) -> None:
    config.check_tensor_parallel(layout.tp)
    config.check_expert_parallel(layout.ep, layout.etp)
    if layout.pp > config.num_layers:
        raise ConfigError(f"--pp {layout.pp} is above model.num_layers={config.num_layers}; every stage needs a layer")


class OurSource:
    """A validated directory of ours: metadata, mapping, and every rank file's header."""

    def __init__(self, path: str):
        self.dir = path
        meta_path = os.path.join(path, METADATA)
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{meta_path}: cannot read it ({e})") from None
        self.family = self.meta["family"]
        self.config = GPTConfig(**self.meta["model"])
        self.layout = Layout.from_json(self.meta["layout"])
        self.mapping = Mapping(self.family, self.config, self.layout)
        self.files = self.mapping.files()

    def validate(self, only: Optional[Iterable[str]] = None) -> None:
        for fname in (only or self.files):
            path = os.path.join(self.dir, fname)
            if not os.path.isfile(path):
                raise ConvertError(f"{path}: missing shard (listed by the layout in {METADATA})")
            header = read_header(path)
            for t in self.files[fname]:
                entry = header.get(t.name)
                if entry is None:
                    raise ConvertError(f"{path}: tensor {t.name} is missing")
                if tuple(entry["shape"]) != t.shape:
                    raise ConvertError(f"{path}: tensor {t.name} has shape {entry['shape']} but the layout in "
                                       f"{METADATA} implies {list(t.shape)}")


def ours_to_hf(src: str, dst: str) -> str:
    """Export: our directory ``src`` -> a Hugging Face directory ``dst`` (one ``model.safetensors``)."""
    source = OurSource(src)
    source.validate()
    hf_config = hf_from_model(source.family, source.meta["model"], source.meta["hf_config"])
    shapes = source.mapping.hf_shapes()
    dtypes = source.meta.get("hf_dtypes", {})
    contributors: Dict[str, List[Tuple[str, Target, int, object]]] = {name: [] for name in shapes}
    for fname, targets in source.files.items():
        for t in targets:
            offset = 0
            for p in t.pieces:
                if p.source is not None:
                    contributors[p.source].append((fname, t, offset, p))
                offset += p.num_rows
    for copy, original in source.mapping.hf_copies().items():  # written from the one weight we keep
        if dtypes and copy not in dtypes:  # the source had no copy (GLM-4.6's MTP layers)
            del shapes[copy], contributors[copy]
        else:
            contributors[copy] = contributors[original]
    out_dtypes = {}
    for name in shapes:
        fname, t, _, _ = contributors[name][0]
        out_dtypes[name] = TORCH_DTYPES[dtypes[name]] if name in dtypes else \
            TORCH_DTYPES[read_header(os.path.join(src, fname))[t.name]["dtype"]]
    # gpt-oss: the per-expert tensors go back into transformers' fused ones, in their dtype (MXFP4 is not written)
    fused = fused_shapes(shapes) if source.family == "gpt_oss" else {}
    written = {n: s for n, s in shapes.items() if n not in {p for _, parts in fused.values() for p in parts}}
    written.update({n: shape for n, (shape, _) in fused.items()})
    out_dtypes.update({n: out_dtypes[parts[0]] for n, (_, parts) in fused.items()})
    order = sorted(written)
    tmp = _fresh_destination(dst)
    try:
        reader = SliceReader()
        writer = StreamingWriter(os.path.join(tmp, "model.safetensors"),
                                 [(n, out_dtypes[n], written[n]) for n in order], {"format": "pt"})

        def assemble(name):
            return _assemble(src, name, shapes[name], out_dtypes[name], contributors[name], reader)
        for name in order:
            writer.write(name, fuse(name, *fused[name], assemble, out_dtypes[name]) if name in fused
                         else assemble(name))
        writer.close()
        reader.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        extra = os.path.join(src, HF_FILES)
        if os.path.isdir(extra):
            for f in os.listdir(extra):
                shutil.copyfile(os.path.join(extra, f), os.path.join(tmp, f))
        _finish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _assemble(src: str, name: str, shape, dtype, contributors, reader: SliceReader) -> torch.Tensor:
    """One Hugging Face tensor from every piece of it in our files; replicated copies must agree."""
    full = torch.empty(shape, dtype=dtype)
    seen: Dict[Tuple, bool] = {}
    covered = 0
    for fname, target, offset, piece in contributors:
        block = reader.read(os.path.join(src, fname), target.name, (offset, offset + piece.num_rows)).to(dtype)
        rect = (piece.rows, piece.cols)
        region = full[piece.rows[0]:piece.rows[1]]
        if piece.cols is not None:
            region = region[:, piece.cols[0]:piece.cols[1]]
        if rect in seen:
            if not torch.equal(region, block):
                raise ConvertError(f"{os.path.join(src, fname)}: tensor {target.name} disagrees with another rank's "
                                   f"copy of {name}; replicated weights must be identical")
            continue
        seen[rect] = True
        region.copy_(block)
        covered += block.numel()
    if covered != full.numel():
        raise ConvertError(f"{src}: the rank files cover {covered} of {full.numel()} values of {name}")
    return full


def convert(src: str, dst: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None) -> str:
    """The direction follows from ``src``: Hugging Face -> ours at (tp, pp, ep, etp), or ours -> Hugging Face."""
    if is_our_dir(src):
        if (tp, pp, ep, etp) != (1, 1, 1, None):
            raise ConvertError(f"{src} is a ds_megatron checkpoint, which converts to Hugging Face only: drop "
                               "--tp/--pp/--ep/--etp (to change the layout, export and import again)")
        return ours_to_hf(src, dst)
    if is_hf_dir(src):
        return hf_to_ours(src, dst, tp, pp, ep, etp)
    raise ConvertError(f"{src}: neither a Hugging Face checkpoint (config.json) nor ours ({METADATA})")


def main(argv=None) -> int:
    """``ds-megatron convert SRC DST [--tp N] [--pp N] [--ep N] [--etp N]``."""
    p = argparse.ArgumentParser(prog="ds-megatron convert",
                                description="Hugging Face -> ds_megatron at a layout, or ds_megatron -> Hugging Face "
                                            "(the direction follows from SRC)")
    p.add_argument("src", help=f"a Hugging Face directory (config.json) or ours ({METADATA})")
    p.add_argument("dst", help="a new directory (an existing non-empty one is refused)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (import)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (import; uniform split)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (import)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (import; default --tp)")
    args = p.parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.tp, args.pp, args.ep, args.etp)
    except ConfigError as e:
        print(f"ds-megatron convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
