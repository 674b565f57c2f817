"""A built model's own tensors in and out of a checkpoint, each rank only its shards.

``model_tensors(model)``: this rank's parameters under the names of our files
(``GPTModel`` names; experts by global index, whatever the experts class);
``expert_bias_tensors(model)`` the routers' expert-bias buffers, which the files hold too.
``load_weights(model, path, parallel_state, stage_layers)`` fills them from a
Hugging Face directory (converted on the fly: this rank reads only the rows and
columns of its own shards) or from our directory of the same layout.
``save_weights`` writes our directory from a job (each file by one rank) so
that ``ds-megatron convert`` can export it.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config.hf_config import METADATA, RUNTIME_FIELDS
from ..config.job import JobConfig, export_hf_config
from ..data.tokenizer import hf_tokenizer_export_files
from ..errors import ConvertError
from ..moe.moe_layer import BaseMoELayer
from ..utils.collectives import barrier
from .checkpoint import (HF_FILES, HFSource, OurSource, check_layout, extra_files, is_hf_dir, is_our_dir,
                         write_metadata)
from .mapping import Layout, Mapping, Target, dense_file, expert_file, layer_name
from .safetensors_io import DTYPES, SliceReader, StreamingWriter

# Where a training checkpoint holds the model in our layout, for `ds-megatron convert` to export.
JOB_MODEL_DIR = "ds_megatron_model"


def _gpt_named_parameters(model):
    if hasattr(model, "named_gpt_parameters"):
        return model.named_gpt_parameters()
    return model.named_parameters()


def model_tensors(model) -> Dict[str, torch.Tensor]:
    """This rank's parameters (or views of them) under the names our files use."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in _gpt_named_parameters(model):
        if ".mlp.experts." not in name:
            out[name] = p
    for module in model.modules():
        if isinstance(module, BaseMoELayer):
            experts = module.experts
            # a multi-token-prediction layer's (number num_layers + k): named as the one-rank model names it
            layer = layer_name(model.config, module.layer_number)
            for local, e in enumerate(experts.local_expert_indices):
                for key, tensor in experts.expert_weights(local).items():
                    out[f"{layer}.mlp.experts.{e}.{key}"] = tensor
    return out


def expert_bias_tensors(model) -> Dict[str, torch.Tensor]:
    """The routers' ``expert_bias`` buffers (fp32, not parameters) under the names our files use."""
    to_gpt = getattr(model, "gpt_name", lambda name: name)
    return {to_gpt(name): b for name, b in model.named_buffers() if name.endswith("router.expert_bias")}


def _file_tensors(model) -> Dict[str, torch.Tensor]:
    """Every tensor of this rank our files hold: the parameters and the expert-bias buffers."""
    return {**model_tensors(model), **expert_bias_tensors(model)}


def stage_layers(model) -> List[List[int]]:
    """The transformer layers of every pipeline stage of a built model (one stage without PP)."""
    return getattr(model, "all_stage_layers", None) or [list(range(model.config.num_layers))]


def rank_layout(parallel_state, stage_layers: Sequence[Sequence[int]]) -> Layout:
    lay = parallel_state.layout
    return Layout(lay.tp, lay.pp, lay.ep, lay.etp, tuple(tuple(s) for s in stage_layers))


def rank_targets(mapping: Mapping, parallel_state) -> List[Tuple[str, Target]]:
    """(file, target) of every tensor this rank holds."""
    s = parallel_state
    stage = s.pp.rank
    out = [(dense_file(stage, s.tp.rank), t) for t in mapping.dense_targets(stage, s.tp.rank)]
    if mapping.config.num_experts:
        f = expert_file(stage, s.ep.rank, s.etp.rank)
        out += [(f, t) for t in mapping.expert_targets(stage, s.ep.rank, s.etp.rank)]
    return out


def _check_same_model(config, model_config, where: str) -> None:
    for key, value in vars(config).items():
        if key == "mtp_num_layers" and (value or 0) == (model_config.mtp_num_layers or 0):
            continue  # null and 0 are both off
        if key not in RUNTIME_FIELDS and getattr(model_config, key) != value:
            raise ConvertError(f"{where}: the checkpoint has model.{key}={value!r} but the model being loaded has "
                               f"{getattr(model_config, key)!r}; build the model from the checkpoint's config")


def load_weights(model, path: str, parallel_state, stage_layers: Sequence[Sequence[int]]) -> None:
    """Copy this rank's shards from ``path`` (Hugging Face or ours) into ``model``; every tensor checked first."""
    layout = rank_layout(parallel_state, stage_layers)
    config = model.config
    if is_hf_dir(path):
        source = HFSource(path, mtp_num_layers=config.mtp_num_layers or 0)  # the model's MTP layers, or none
        _check_same_model(source.gpt_config(), config, path)
        mapping = Mapping(source.family, config, layout)
        source.validate(mapping)
        reader = SliceReader()

        def read(fname, target):
            return source.build(target, reader)
    elif is_our_dir(path):
        source = OurSource(path)
        _check_same_model(source.config, config, path)
        if source.layout != layout:
            raise ConvertError(f"{os.path.join(path, METADATA)}: layout {source.layout.to_json()} differs from this "
                               f"job's {layout.to_json()}; export it to Hugging Face and load that instead")
        mapping = source.mapping
        reader = SliceReader()

        def read(fname, target):
            return reader.read(os.path.join(path, fname), target.name)
    else:
        raise ConvertError(f"{path}: neither a Hugging Face checkpoint (config.json) nor ours ({METADATA})")
    check_layout(config, layout)
    targets = rank_targets(mapping, parallel_state)
    if is_our_dir(path):
        source.validate({f for f, _ in targets})
    elif parallel_state.pp.rank == parallel_state.pp.size - 1:  # the stage that holds the MTP layers
        vocab = next((t for _, t in targets if t.name == "word_embeddings.weight"), None)
        source.check_copies(mapping, reader, vocab.pieces[0].rows if vocab and vocab.pieces[0].source else None)
    tensors = _file_tensors(model)
    names = [t.name for _, t in targets]
    if sorted(names) != sorted(tensors):
        missing = sorted(set(tensors) - set(names)) or sorted(set(names) - set(tensors))
        raise ConvertError(f"{path}: this rank's tensors and the model's differ ({', '.join(missing[:3])}); a "
                           "converter bug or a model built with another layout")
    with torch.no_grad():
        for fname, target in targets:
            tensors[target.name].copy_(read(fname, target))
    reader.close()


def save_weights(model, directory: str, parallel_state, stage_layers: Sequence[Sequence[int]], family: str,
                 hf_config: Dict, hf_dtypes: Optional[Dict[str, str]] = None,
                 files: Optional[Dict[str, bytes]] = None) -> None:
    """Write our directory from a job: each file by the first data-parallel replica holding it (collective);
    ``files`` (tokenizer, generation config) go to its ``hf_files/``, which the export copies beside the weights."""
    layout = rank_layout(parallel_state, stage_layers)
    mapping = Mapping(family, model.config, layout)
    tensors = _file_tensors(model)
    s = parallel_state
    # a pipeline stage of dense layers only still has its (empty) expert file, which the layout lists
    by_file: Dict[str, List[Target]] = ({expert_file(s.pp.rank, s.ep.rank, s.etp.rank): []}
                                        if model.config.num_experts else {})
    for fname, t in rank_targets(mapping, s):
        by_file.setdefault(fname, []).append(t)
    os.makedirs(directory, exist_ok=True)
    for fname, targets in by_file.items():
        writer_rank = s.dp.rank == 0 if fname.startswith("model_") else s["edp"].rank == 0
        if not writer_rank:
            continue
        writer = StreamingWriter(os.path.join(directory, fname), [(t.name, tensors[t.name].dtype, t.shape)
                                                                  for t in targets], {"format": "pt"})
        for t in targets:
            writer.write(t.name, tensors[t.name].detach().cpu())
        writer.close()
    if dist.get_rank() == 0:
        write_metadata(directory, family, model.config, layout, hf_config, hf_dtypes or {})
        if files:
            os.makedirs(os.path.join(directory, HF_FILES), exist_ok=True)
            for name, data in files.items():
                with open(os.path.join(directory, HF_FILES, name), "wb") as f:
                    f.write(data)
    barrier(parallel_state.world)


def save_job_model(model, job: JobConfig, parallel_state, tag_dir: str) -> None:
    """A training job's weights in our layout inside checkpoint ``tag_dir`` (``ds-megatron convert`` exports them;
    collective).

    The family and config.json come from ``load_hf``'s checkpoint, or from the model section
    (``train.export_hf_family``); the non-weight files of ``load_hf`` (tokenizer, generation config) go along,
    and the job's own Hugging Face tokenizer replaces the tokenizer files, so the export loads with AutoTokenizer."""
    files: Dict[str, bytes] = {}
    load_hf = job.train.load_hf
    if not load_hf:
        family, hf_config, hf_dtypes = job.train.export_hf_family, export_hf_config(job.megatron), None
    elif is_hf_dir(load_hf):
        source = HFSource(load_hf)
        family, hf_config = source.family, source.hf_config
        hf_dtypes = {n: DTYPES[dt] for n, (_, dt, _) in source.table.items()}
        files = extra_files(load_hf)
    else:
        source = OurSource(load_hf)
        family, hf_config, hf_dtypes = source.family, source.meta["hf_config"], source.meta.get("hf_dtypes")
        files = extra_files(os.path.join(load_hf, HF_FILES))
    files.update(hf_tokenizer_export_files(job.data.tokenizer, job.data.eod_token))
    save_weights(model, os.path.join(tag_dir, JOB_MODEL_DIR), parallel_state, stage_layers(model), family, hf_config,
                 hf_dtypes, files)
