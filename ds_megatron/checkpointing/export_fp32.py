"""``ds-megatron export-fp32 CHECKPOINT OUT``: a training checkpoint as one fp32 state dict of ``GPTModel``.

DeepSpeed's ``zero_to_fp32.py`` consolidates ZeRO partitions; it knows nothing of tensor or expert
parallelism, and DeepSpeed writes it only next to ZeRO checkpoints (``_save_zero_checkpoint``,
``runtime/engine.py:5567``), which our optimizer path never writes.  This is its counterpart for
our checkpoints, at any TP / PP / EP / ETP / DP.  A ``ckpt_format: "torch_dist"`` checkpoint holds the
whole model's tensors already (every layout, gated fc1 and replicated KV heads included); a DeepSpeed-format one
is put together from its rank files:

* ``ds_megatron.save_checkpoint`` records, in each tensor / pipeline rank's
  ``mp_rank_XX_model_states.pt``, how that rank's weights map to the whole model
  (``export_record``): each parameter's ``GPTModel`` name and the dimension TP splits
  it along, which entries are experts (their own files hold them), and, under PP,
  which entry of which ``layer_XX-model_YY-model_states.pt`` file is which parameter (DeepSpeed's
  ``PipelineEngine``), or which entry of the rank's own file (our pipeline runtime's chunks).
* Dense weights are placed where ``global_shards`` (the layout-independent
  checkpoint's map) puts each rank's rows: blocks of rows or columns, a gated fc1's
  ``[gate; up]`` halves, the KV heads copied over TP ranks.  Every element of every
  tensor must be written, and copies of a tensor (replicated norms, KV copies) must
  agree bit for bit, or nothing is exported.  Experts come from the expert files
  (``layer_L_expert_E_mp_rank_T``, T the expert-tensor rank), concatenated over the
  expert-tensor ranks (a gated fc1 half by half), under ``SequentialMLP``'s names.
* The word embedding keeps the rows of a TP=1 model (the rows added for a larger
  TP's padding are zero and never read), every floating tensor becomes fp32.
* Under ZeRO 3 (DeepSpeed's optimizer path) the rank files hold no weights
  (``zero_pp_rank_<D>_mp_rank_<TT>_model_states.pt``: empty placeholders, the record, ``param_shapes``); each
  tensor-parallel rank's fp32 weights are put together from its data-parallel ranks' optimizer files
  (``..._optim_states.pt``), then placed like any rank's weights (``_zero3_modules``).
* Version 1 records (before the record carried the model config) are joined by
  concatenation, which cannot express a gated fc1 over TP or KV copies: those refuse.

The result loads into a TP=1 ``GPTModel`` of the same config (``load_state_dict``, strict).
``OUT`` ending in ``.safetensors`` is a safetensors file, anything else ``torch.save``'s; either is written beside
``OUT`` and renamed onto it, with the mode the umask gives (safetensors' own ``save_file`` makes 0600).

DeepSpeed's own optimizer path (``optimizer_impl: "deepspeed"`` with ZeRO 1/2) does get
``zero_to_fp32.py`` / ``zero_to_torch.py`` beside its checkpoints.  With data parallelism alone
they give this module's weights exactly; with TP / PP / EP they fail (they expect one optimizer
file per data-parallel rank) or would miss the other model-parallel ranks' shards, so the job
replaces them with ``ZERO_SCRIPT_REFUSAL`` (``guard_zero_recovery_scripts``), which names this command.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import uuid
import warnings
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch

from ..convert.safetensors_io import StreamingWriter
from ..models import GPTConfig
from ..models.gpt import OutputLayer
from ..moe.moe_layer import BaseMoELayer
from ..tensor_parallel import VocabParallelEmbedding, pad_vocab_size
from ..tensor_parallel.params import is_expert_param
from .global_shards import GlobalLayoutError, RankCoordinates, global_shards

ZERO_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# What the two scripts become beside a model-parallel checkpoint: one line naming the command that works.
ZERO_SCRIPT_REFUSAL = '''"""Written by ds_megatron in place of DeepSpeed's {name}: see the message below."""
import sys

sys.exit("{name}: this checkpoint holds a ds_megatron model split at {layout}; DeepSpeed's zero_to_fp32 "
         "merges data-parallel ZeRO partitions only and cannot consolidate it. Run instead: "
         "ds-megatron export-fp32 CHECKPOINT_DIR model.safetensors [--tag iter_XXXXXXX]")
'''


def guard_zero_recovery_scripts(save_dir: str, tp: int, pp: int, ep: int) -> List[str]:
    """Replace DeepSpeed's recovery scripts in ``save_dir`` when the model is split (TP, PP or EP > 1); the paths."""
    if tp == pp == ep == 1:
        return []  # pure data parallelism: DeepSpeed's scripts give the right weights
    layout = f"TP={tp} x PP={pp} x EP={ep}"
    replaced = []
    for name in ZERO_RECOVERY_SCRIPTS:
        path = os.path.join(save_dir, name)
        if os.path.isfile(path):
            with open(path, "w") as f:
                f.write(ZERO_SCRIPT_REFUSAL.format(name=name, layout=layout))
            replaced.append(path)
    return replaced


RECORD_KEY = "ds_megatron_export"
RECORD_VERSION = 2  # 2: the record carries the model config and the shards are placed by global_shards
# SequentialMLP's expert weights as the expert files name them ([out, in]): fc1 is split over the
# expert-tensor ranks along its output rows, fc2 along its input columns (column- / row-parallel).
# fc1's rows, fc2's columns; gpt-oss's biases: fc1's with its rows, fc2's by hidden columns (moe/experts.py)
EXPERT_PARTITION_DIMS = {"linear_fc1.weight": 0, "linear_fc2.weight": 1, "linear_fc1.bias": 0, "linear_fc2.bias": 0}
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message names the file and what is wrong."""


def export_record(module: torch.nn.Module, parallel_state, layer_files: Optional[Dict[str, Dict[str, Any]]] = None
                  ) -> Optional[Dict[str, Any]]:
    """What ``export_fp32`` needs to know about this rank's weights (saved with its checkpoint); None for a
    model that is not our GPT (``GPTModel`` or a pipeline stage of it): the export writes ``GPTModel``'s names.

    ``layer_files`` (pipeline): ``{"layer_XX": {entry: tensor}}``, the entries DeepSpeed writes per layer.
    """
    if not isinstance(getattr(module, "config", None), GPTConfig):
        return None
    config = module.config
    to_gpt = getattr(module, "gpt_name", lambda name: name)  # a pipeline stage names pieces its own way
    names = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        names.setdefault(id(tensor), to_gpt(name))
    params = dict(module.named_parameters())
    record = {
        "version": RECORD_VERSION,
        "model": asdict(config),
        "tp": parallel_state.tp.size, "tp_rank": parallel_state.tp.rank,
        "pp": parallel_state.pp.size, "pp_rank": parallel_state.pp.rank,
        "etp": parallel_state.etp.size,
        "partition_dims": {to_gpt(n): int(getattr(p, "partition_dim", -1)) for n, p in params.items()
                           if getattr(p, "tensor_model_parallel", False) and not is_expert_param(p)},
        "experts": sorted(to_gpt(n) for n, p in params.items() if is_expert_param(p)),
        "moe_layers": sum(1 for m in module.modules() if isinstance(m, BaseMoELayer)),
        "vocab_params": sorted(to_gpt(f"{n}.weight") for n, m in module.named_modules()
                               if isinstance(m, (VocabParallelEmbedding, OutputLayer))),
        "vocab_rows": pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, 1),
    }
    if layer_files is not None:
        record["layer_files"] = {layer: {entry: names[id(t)] for entry, t in entries.items()}
                                 for layer, entries in layer_files.items()}
    elif hasattr(module, "gpt_name"):  # our runtime's chunks: the module entry holds them under their own names
        record["module_names"] = {key: to_gpt(key) for key in module.state_dict()}
    return record


def resolve_tag_dir(checkpoint: str, tag: Optional[str] = None) -> str:
    """``checkpoint`` is a run directory (with ``latest``) or one tag's directory."""
    if tag is not None:
        return os.path.join(checkpoint, tag)
    latest = os.path.join(checkpoint, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(checkpoint, f.read().strip())
    return checkpoint


def _load(path: str) -> Dict[str, Any]:
    # DeepSpeed's model-state files hold Python objects besides tensors (its config, our record).
    return torch.load(path, map_location="cpu", weights_only=False)


def _cat(pieces: Dict[int, torch.Tensor], size: int, dim: int, what: str) -> torch.Tensor:
    if sorted(pieces) != list(range(size)):
        raise ExportError(f"{what}: the checkpoint holds ranks {sorted(pieces)} of {size}; files are missing")
    return pieces[0] if dim < 0 else torch.cat([pieces[r] for r in range(size)], dim=dim)


def _consolidate_torch_dist(tag_dir: str) -> Dict[str, torch.Tensor]:
    """A ``ckpt_format: "torch_dist"`` checkpoint already stores the one-rank model's tensors (``model.<name>``,
    ``global_shards``): read them whole, on one process."""
    import torch.distributed.checkpoint as dcp  # here, not at import: ~1.7 s (see torch_dist)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(tag_dir)
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in reader.read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise ExportError(f"{tag_dir} holds no model.* tensors: not a ds_megatron torch_dist checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k[len("model."):]: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def consolidate(tag_dir: str) -> Dict[str, torch.Tensor]:
    """The whole model's weights in ``tag_dir``, fp32, under ``GPTModel``'s names."""
    if os.path.isfile(os.path.join(tag_dir, ".metadata")):  # torch.distributed.checkpoint's, written last
        return _consolidate_torch_dist(tag_dir)
    rank_files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if not rank_files and glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_*_model_states.pt")):
        modules = _zero3_modules(tag_dir)
        return {k: v.contiguous() for k, v in _place_dense(modules).items()}
    if not rank_files:
        raise ExportError(f"{tag_dir} holds no mp_rank_*_model_states.pt: not a DeepSpeed checkpoint directory "
                          "(give the run directory with 'latest', or one checkpoint's directory)")
    modules = []  # (file, record, its dense tensors under GPTModel's names)
    records: List[Dict[str, Any]] = []
    for path in rank_files:
        saved = _load(path)
        record = saved.get(RECORD_KEY)
        if record is None:
            raise ExportError(f"{path} has no {RECORD_KEY} record: the checkpoint was not saved by "
                              "ds_megatron.save_checkpoint (the training job's checkpoints are) from a GPTModel, "
                              "GPTModelChunks or GPTPipelineModule")
        if record.get("version") not in (1, RECORD_VERSION):
            raise ExportError(f"{path}: {RECORD_KEY} version {record.get('version')}, this ds_megatron reads "
                              f"versions 1 to {RECORD_VERSION}")
        if record.get("unsupported"):  # version 1 only
            raise ExportError(f"{path}: export-fp32 cannot join this layout's shards ({'; '.join(record['unsupported'])}); "
                              "export a job started with --load-hf through `ds-megatron convert "
                              "iter_*/ds_megatron_model DST`, or train at tensor_model_parallel_size 1")
        records.append(record)
        if "layer_files" in record:  # pipeline: DeepSpeed wrote this stage's layers to files of their own
            module = {}
            for layer, entries in record["layer_files"].items():
                layer_state = _load(os.path.join(tag_dir, f"{layer}-model_{record['tp_rank']:02d}-model_states.pt"))
                module.update({name: layer_state[entry] for entry, name in entries.items()})
        else:
            renamed = record.get("module_names", {})
            module = {renamed.get(key, key): t for key, t in saved["module"].items()}
        experts = set(record["experts"])
        modules.append((path, record, {name: t for name, t in module.items() if name not in experts}))
    first = records[0]
    stages = {r["pp_rank"] for r in records}
    if stages != set(range(first["pp"])):
        raise ExportError(f"{tag_dir}: pipeline stages {sorted(stages)} of {first['pp']} have files; some are missing")
    moe_layers = sum(r["moe_layers"] for r in records if r["tp_rank"] == 0)
    if "model" not in first and first["etp"] > 1 and moe_layers:  # version 1: is each expert's fc1 [gate; up]?
        raise ExportError(f"{tag_dir}: a version 1 record does not say whether the experts' fc1 is gated, which "
                          f"decides how its {first['etp']} expert-tensor shards join; load the checkpoint with this "
                          "ds_megatron and save it again, then export")
    full = _place_dense(modules) if first["version"] >= 2 else _concatenate_dense(modules)
    full.update(_experts(tag_dir, first["etp"], moe_layers,
                         bool(first.get("model", {}).get("gated_linear_unit", False))))
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in full.items()}


_ZERO3_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _zero3_modules(tag_dir: str) -> List[Any]:
    """``(file, record, {name: fp32 tensor})`` of every model-parallel rank of a ZeRO 3 checkpoint.

    ZeRO 3 splits each parameter of a param group into ``partition_count`` equal pieces (the last padded), in
    the group's order, and data-parallel rank D holds piece D of every parameter, one after the other, in its
    fp32 flat groups (DeepSpeed's ``zero_to_fp32.py`` reads them the same way).  The parameters and their order
    are the model file's ``param_shapes`` (one ordered dict per group).
    """
    ranks: Dict[int, Dict[int, str]] = {}
    for path in glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_*_model_states.pt")):
        match = _ZERO3_FILE.search(os.path.basename(path))
        ranks.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    modules = []
    for mp_rank in sorted(ranks):
        saved = _load(ranks[mp_rank][min(ranks[mp_rank])])
        record = saved.get(RECORD_KEY)
        if record is None:
            raise ExportError(f"{ranks[mp_rank][min(ranks[mp_rank])]} has no {RECORD_KEY} record: the checkpoint was "
                              "not saved by ds_megatron.save_checkpoint from a GPTModel")
        flats = {}
        for dp_rank in sorted(ranks[mp_rank]):
            optim = os.path.join(tag_dir, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
            if not os.path.isfile(optim):
                raise ExportError(f"{optim} is missing: ZeRO 3 keeps the weights in the optimizer files")
            state = _load(optim)["optimizer_state_dict"]
            count = state["partition_count"]
            count = max(count) if isinstance(count, (list, tuple)) else count
            flats[dp_rank] = torch.cat([g.float() for g in state["fp32_flat_groups"]])
        if sorted(flats) != list(range(count)):
            raise ExportError(f"{tag_dir}: ZeRO 3 files of data-parallel ranks {sorted(flats)} for model-parallel "
                              f"rank {mp_rank}, the checkpoint was split over {count}; some are missing")
        tensors, offset = {}, 0
        for group in saved["param_shapes"]:
            for name, shape in group.items():
                numel = int(torch.Size(shape).numel())
                piece = -(-numel // count)
                whole = torch.cat([flats[d][offset:offset + piece] for d in range(count)])
                tensors[name] = whole[:numel].view(shape)
                offset += piece
        if offset != flats[0].numel():
            raise ExportError(f"{tag_dir}: model-parallel rank {mp_rank}'s parameters fill {offset} elements of its "
                              f"{flats[0].numel()}-element ZeRO 3 partition; the files do not belong together")
        modules.append((ranks[mp_rank][min(ranks[mp_rank])], record, tensors))
    return modules


def _place_dense(modules) -> Dict[str, torch.Tensor]:
    """Every rank file's dense tensors put where ``global_shards`` places them in the one-rank model."""
    config = GPTConfig(**modules[0][1]["model"])
    full: Dict[str, torch.Tensor] = {}
    written: Dict[str, torch.Tensor] = {}  # per element: placed yet
    for path, record, tensors in modules:
        coordinates = RankCoordinates(tp=record["tp"], tp_rank=record["tp_rank"])
        for name, tensor in tensors.items():
            try:
                shards = global_shards(config, name, tuple(tensor.shape), name in record["partition_dims"],
                                       coordinates)
            except GlobalLayoutError as e:
                raise ExportError(f"{path}: {e}") from None
            for shard in shards:
                piece = tensor[shard.local_rows[0]:shard.local_rows[1]] if tensor.dim() else tensor
                if shard.name not in full:
                    full[shard.name] = torch.zeros(shard.global_shape, dtype=tensor.dtype)
                    written[shard.name] = torch.zeros(shard.global_shape, dtype=torch.bool)
                region = tuple(slice(o, o + n) for o, n in zip(shard.offsets, piece.shape))
                seen = written[shard.name][region]
                if seen.any() and not torch.equal(full[shard.name][region][seen], piece[seen]):
                    raise ExportError(f"{path}: {name} differs from another rank's copy of the same rows of "
                                      f"{shard.name}; the checkpoint's ranks are not from one step")
                full[shard.name][region] = piece
                written[shard.name][region] = True
    for name, mask in written.items():
        if not bool(mask.all()):
            raise ExportError(f"{modules[0][0]}: {int((~mask).sum())} elements of {name} are in no rank's file; "
                              "some tensor-parallel ranks' files are missing")
    return full


def _concatenate_dense(modules) -> Dict[str, torch.Tensor]:
    """Version 1 records: dense shards concatenated along their partition dim over the tensor ranks."""
    first = modules[0][1]
    shards: Dict[str, Dict[int, torch.Tensor]] = {}
    for _, record, tensors in modules:
        for name, tensor in tensors.items():
            shards.setdefault(name, {})[record["tp_rank"]] = tensor
    partition_dims = {k: v for _, r, _ in modules for k, v in r["partition_dims"].items()}
    full = {name: _cat(pieces, first["tp"], partition_dims.get(name, -1), name) for name, pieces in shards.items()}
    for name in first["vocab_params"]:
        full[name] = full[name][:first["vocab_rows"]]  # TP=1's padding; the rows beyond are zero, never read
    return full


def _experts(tag_dir: str, etp: int, moe_layers: int, gated: bool) -> Dict[str, torch.Tensor]:
    """The expert files' tensors joined over the expert-tensor ranks (``gated``: each rank's fc1 rows are its
    ``[gate; up]`` blocks, joined half by half)."""
    pieces: Dict[str, Dict[int, torch.Tensor]] = {}
    layers = set()
    for path in glob.glob(os.path.join(tag_dir, "layer_*_expert_*_mp_rank_*_model_states.pt")):
        match = _EXPERT_FILE.search(os.path.basename(path))
        layers.add(int(match.group(1)))
        for key, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            pieces.setdefault(key, {})[int(match.group(3))] = tensor
    if len(layers) != moe_layers:
        raise ExportError(f"{tag_dir}: expert files of {len(layers)} MoE layers, the model has {moe_layers}")
    out = {}
    for key, by_rank in pieces.items():
        leaf = ".".join(key.split(".")[-2:])
        if leaf not in EXPERT_PARTITION_DIMS:
            raise ExportError(f"{tag_dir}: expert weight {key} is not one of {sorted(EXPERT_PARTITION_DIMS)}")
        if gated and leaf.startswith("linear_fc1."):  # the whole gate, then the whole up
            out[key] = torch.cat([_cat({r: t.chunk(2)[i] for r, t in by_rank.items()}, etp, 0, key) for i in (0, 1)])
        else:
            out[key] = _cat(by_rank, etp, EXPERT_PARTITION_DIMS[leaf], key)
    return out


def save_state_dict(state: Dict[str, torch.Tensor], out: str) -> None:
    """``state`` to ``out`` atomically (a temporary file beside it, renamed), created by ``open`` so that its mode
    follows the umask."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if out.endswith(".safetensors"):
            writer = StreamingWriter(tmp, [(name, t.dtype, tuple(t.shape)) for name, t in state.items()],
                                     {"format": "pt"})
            for name, t in state.items():
                writer.write(name, t)
            writer.close()
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-megatron export-fp32",
                                     description="Consolidate a ds_megatron training checkpoint (any TP / PP / EP / "
                                                 "DP) into one fp32 state dict with GPTModel's parameter names.")
    parser.add_argument("checkpoint", help="run directory (its 'latest' is read) or one checkpoint's directory")
    parser.add_argument("out", help="output file: .safetensors for safetensors, anything else torch.save")
    parser.add_argument("--tag", default=None, help="checkpoint tag inside CHECKPOINT (default: its 'latest')")
    args = parser.parse_args(argv)
    try:
        state = consolidate(resolve_tag_dir(args.checkpoint, args.tag))
    except ExportError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    save_state_dict(state, args.out)
    print(f"{args.out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters (fp32)")
    return 0


__all__ = ["EXPERT_PARTITION_DIMS", "ExportError", "RECORD_KEY", "consolidate", "export_record", "main",
           "resolve_tag_dir", "save_state_dict"]
