"""Pipeline parallelism through DeepSpeed's ``PipelineModule`` / ``PipelineEngine``, on our process groups.

Two things come from here:

* ``pipeline_topology(layout)``: the ``ProcessTopology`` DeepSpeed's pipeline
  grid is built from.  Its axes are the tokens of our ``order`` read slowest
  first (``tp-cp-ep-dp-pp`` -> ``pipe, data, model``), so that its row-major
  rank numbering is our ``RankGenerator``'s: DeepSpeed's pipe, data and model
  groups, p2p neighbours, stage ids and tied-weight groups are our ``pp``,
  ``dp``, ``tp`` and ``embedding`` groups, rank for rank
  (``check_topology_matches`` proves it for the job at hand, and refuses
  otherwise).
* ``GPTPipelineModule``: the GPT as a sequence of pipeline layers,

  ``[word embedding (tied), positions, layer 0 ... layer N-1, final LayerNorm, output layer (tied)]``,

  split by ``config.pipeline`` (embedding with the first stage's layers, norm
  and output with the last's).  With ``untie_embeddings_and_output_weights``
  the two ends are plain modules: the first stage owns the word embedding, the
  last its own ``output_layer``, and nothing is tied.  Every stage builds every piece in
  ``build_gpt_modules`` order and keeps its own, so any PP size built after
  the same seed holds the same full model as ``GPTModel``.  The output layer
  is a ``TiedLayerSpec`` of the word embedding: the first and last stage each
  hold a copy, equal at start, whose gradients are summed over the
  ``embedding`` group by ``finalize_model_grads`` (DeepSpeed's own tied
  all-reduce reads ``.grad``, which our gradient buffers leave empty); the
  last stage's copy is marked ``shared`` so that the gradient norm counts it
  once.  The loss is the vocab-parallel cross entropy on the last stage.

DeepSpeed seams (``integration.seams``): the subclass overrides
``_partition_layers`` (to place the layers as ``config.pipeline`` says instead
of DeepSpeed's own methods: ``seams.set_pipeline_parts``) and
``_synchronize_tied_weights`` (the same broadcast, under ``no_grad``), and hands
already-built modules to ``PipelineModule.__init__``, which keeps its local
slice; the tied weights are read with ``seams.tied_weights`` and the module's own
groups released with ``seams.release_pipeline_module_groups``.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import PipelineModule, ProcessTopology, TiedLayerSpec

from ..config.model import GPTConfig
from ..config.parallel import ParallelConfig
from ..config.pipeline import pipeline_grid_axes
from ..errors import ConfigError
from ..models.gpt import build_gpt_modules, language_model_loss, output_logits, set_recompute_method
from ..models.gpt_chunks import GPTModelChunks, register_routing_loss_hooks
from ..moe.aux_loss_tracker import MoEAuxLossTracker
from ..moe.moe_layer import BaseMoELayer
from ..parallel.layout import ParallelLayout
from ..parallel_state import ParallelState
from ..planning.param_counts import pipeline_stage_layers
from ..tensor_parallel import RNGStatesTracker, pad_vocab_size
from .seams import release_pipeline_module_groups, set_pipeline_parts, tied_weights

_AXIS_NAMES = {"pp": "pipe", "dp": "data", "tp": "model"}
TIED_EMBEDDING = "word_embeddings"


def pipeline_topology(layout: ParallelLayout) -> ProcessTopology:
    """DeepSpeed's ``ProcessTopology`` with our dense rank numbering (see the module docstring).

    Context parallelism: the cp ranks hold replicas of the same weights, as dp ranks do, so DeepSpeed's
    ``data`` axis is our dp-cp (``config.pipeline.pipeline_grid_axes``)."""
    sizes = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "cp": layout.cp, "ep": 1}
    axes = pipeline_grid_axes(layout.dense_generator().order, sizes)
    return ProcessTopology(axes=[_AXIS_NAMES["dp" if "dp" in axis else axis[0]] for axis in axes],
                           dims=[math.prod(sizes[t] for t in axis) for axis in axes])


def parallel_config_of(model: PipelineModule) -> ParallelConfig:
    """The layout of a plain DeepSpeed pipeline job (no ``"megatron"`` section): its module's own topology, read
    as ``deepspeed.initialize`` takes it (axes slowest first; our order lists them fastest first)."""
    topology = model.topology()
    axes = topology.get_axis_names()
    tokens = {name: ours for ours, name in _AXIS_NAMES.items()}
    unknown = [a for a in axes if a not in tokens]
    if unknown:
        raise ConfigError(f"the PipelineModule's topology has axes {axes}; without a \"megatron\" section "
                          f"ds_megatron.initialize reads {sorted(tokens)} only: add a \"megatron\" section with "
                          "the sizes, or call deepspeed.initialize")
    return ParallelConfig(tensor_model_parallel_size=topology.get_dim("model") if "model" in axes else 1,
                          pipeline_model_parallel_size=topology.get_dim("pipe"),
                          order="-".join(tokens[a] for a in reversed(axes)))


def check_topology_matches(topology: ProcessTopology, parallel_state: ParallelState) -> None:
    """DeepSpeed's pipe / data / model groups and tied-embedding pairs equal ours, for every rank; else ConfigError."""
    ours = parallel_state.all_ranks
    theirs = {"pp": topology.get_axis_comm_lists("pipe"), "dp": topology.get_axis_comm_lists("data"),
              "tp": topology.get_axis_comm_lists("model")}
    for kind, groups in theirs.items():
        if kind == "tp" and parallel_state.layout.tp == 1:
            groups = [[r] for r in range(parallel_state.layout.world_size)]
        mine = ours["dp-cp" if kind == "dp" else kind]  # DeepSpeed's data axis holds the cp ranks too
        if sorted(map(list, mine)) != sorted(map(list, groups)):
            raise ConfigError(f"megatron.order {parallel_state.layout.order!r}: DeepSpeed's pipeline topology gives "
                              f"{kind} groups {groups} but the Megatron layout has {mine}; use an order whose "
                              "tp, dp and pp tokens DeepSpeed can express (e.g. the default tp-cp-ep-dp-pp)")
    embedding = sorted(sorted({g[0], g[-1]}) for g in theirs["pp"])  # one stage: first and last are one rank
    if embedding != sorted(sorted(g) for g in ours["embedding"]):
        raise ConfigError(f"megatron.order {parallel_state.layout.order!r}: the first/last stage pairs differ "
                          "between DeepSpeed's topology and the Megatron embedding groups")


class _BuiltTiedLayer(TiedLayerSpec):
    """A ``TiedLayerSpec`` whose module was built already (in the model's RNG order); None on stages without it."""

    def __init__(self, key: str, module_type: type, module: Optional[torch.nn.Module],
                 forward_fn: Optional[Callable] = None):
        super().__init__(key, module_type, forward_fn=forward_fn, tied_weight_attr="weight")
        self.module = module

    def build(self, log=False):
        if self.module is None:
            raise RuntimeError(f"tied layer {self.key!r} is not held by this stage")
        return self.module


class GPTPipelineModule(PipelineModule):
    """The GPT of ``config`` split over ``parallel_state``'s pipeline stages (see the module docstring).

    ``partition_method`` / ``layers_per_stage`` / ``first_stage_layers`` / ``last_stage_layers``: the
    ``megatron.pipeline_partition_method``, ``pipeline_num_layers_per_stage`` and
    ``decoder_first/last_pipeline_num_layers`` settings.  ``stage_layers`` (global layer indices on this stage),
    ``is_first_stage``, ``is_last_stage`` and ``padded_vocab_size`` describe what this rank holds.
    """

    def __init__(self, config: GPTConfig, parallel_state: ParallelState,
                 rng_tracker: Optional[RNGStatesTracker] = None, *, partition_method: str = "uniform",
                 layers_per_stage: Optional[Sequence[int]] = None, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None):
        layout = parallel_state.layout
        config.check_layout(layout)
        topology = pipeline_topology(layout)
        check_topology_matches(topology, parallel_state)
        pp, stage = layout.pp, parallel_state.pp.rank
        ranges = pipeline_stage_layers(config, layout, partition_method, layers_per_stage, first_stage_layers,
                                       last_stage_layers)
        n_items = config.num_layers + 4
        # Item i+2 is transformer layer i; 0, 1 (embedding) go with stage 0; the last two with the last stage.
        self._megatron_parts = [0] + [2 + r.stop for r in ranges[:-1]] + [n_items]
        self.stage_layers = ranges[stage]
        self.all_stage_layers = [list(r) for r in ranges]
        self.is_first_stage, self.is_last_stage = stage == 0, stage == pp - 1
        self.config, self.tp, self.cp, self.rng_tracker = config, parallel_state.tp, parallel_state.cp, rng_tracker
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, layout.tp)
        self.moe_aux_loss_tracker = MoEAuxLossTracker() if config.num_experts else None
        self._aux_loss_grad_scale: Optional[Callable[[], torch.Tensor]] = None

        specs: List[object] = [None] * n_items
        word_embeddings = None
        for name, module in build_gpt_modules(config, parallel_state, rng_tracker, self.moe_aux_loss_tracker):
            if name == "word_embeddings":
                keep = self.is_first_stage or (self.is_last_stage and not config.untie_embeddings_and_output_weights)
                word_embeddings = module if keep else None
                embedding_type = type(module)
            elif name == "position_embeddings":
                specs[1] = module if self.is_first_stage else None
            elif name.startswith("layers."):
                index = int(name.split(".")[1])
                specs[2 + index] = module if index in self.stage_layers else None
            elif name == "final_layernorm":
                specs[n_items - 2] = module if self.is_last_stage else None
            elif name == "output_layer":
                specs[n_items - 1] = module if self.is_last_stage else None
            del module  # pieces of other stages are dropped as they come
        tied = not config.untie_embeddings_and_output_weights
        if tied:
            specs[0] = _BuiltTiedLayer(TIED_EMBEDDING, embedding_type, word_embeddings if self.is_first_stage else None)
            specs[n_items - 1] = _BuiltTiedLayer(TIED_EMBEDDING, embedding_type,
                                                 word_embeddings if self.is_last_stage else None,
                                                 forward_fn=self._output_layer)
        else:
            specs[0] = word_embeddings if self.is_first_stage else None
        if tied and word_embeddings is not None and pp > 1:
            # One bucket of its own on both stages (aligned distributed-optimizer shards), counted once in norms.
            word_embeddings.weight.shared_embedding = True
            if self.is_last_stage:
                word_embeddings.weight.shared = True
        set_recompute_method([specs[2 + i] for i in self.stage_layers], config)  # "block": the stage's first
        for spec in specs[2:n_items - 2]:
            if spec is not None and isinstance(getattr(spec, "mlp", None), BaseMoELayer):
                register_routing_loss_hooks(spec, self._routing_loss_scale)
        super().__init__(specs, topology=topology, loss_fn=self._loss, partition_method="megatron",
                         activation_checkpoint_interval=0)

    def _partition_layers(self, method="megatron"):
        # Seam: DeepSpeed's own methods would re-split (and build) the layers; ours are placed already.
        set_pipeline_parts(self, self._megatron_parts, self.stage_id)

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied weights in place outside no_grad, which leaves autograd's
        # "no kernel for c10d::broadcast_" warning on every later backward through them.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _output_layer(self, word_embeddings: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(hidden, word_embeddings.weight, self.config, self.tp)

    def _loss(self, logits: torch.Tensor, labels) -> torch.Tensor:
        labels, loss_mask = labels if isinstance(labels, (tuple, list)) else (labels, None)
        return language_model_loss(logits, labels, loss_mask, self.config, self.tp, cp=self.cp)

    def set_aux_loss_gradient_scale(self, scale: Callable[[], torch.Tensor]) -> None:
        """What one unit of routing loss weighs in backward: loss scale / micro-batches (set by ``initialize``)."""
        self._aux_loss_grad_scale = scale

    def _routing_loss_scale(self):
        if self._aux_loss_grad_scale is None:
            raise RuntimeError("GPTPipelineModule: the gradient scale of the MoE routing losses was never set; build "
                               "the engine with ds_megatron.initialize (or call set_aux_loss_gradient_scale)")
        return self._aux_loss_grad_scale()

    def gpt_name(self, name: str) -> str:
        """A parameter or submodule name of this stage as ``GPTModel`` names it (``3.mlp.fc1`` -> ``layers.1.mlp.fc1``)."""
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            return rest  # word_embeddings.weight
        index = int(head)
        if index == 1:
            return f"position_embeddings.{rest}"
        if index == self.config.num_layers + 2:
            return f"final_layernorm.{rest}"
        if index == self.config.num_layers + 3:
            return f"output_layer.{rest}"
        if index == 0:
            return f"word_embeddings.{rest}"
        return f"layers.{index - 2}.{rest}"

    def named_gpt_parameters(self):
        """``(GPTModel name, param)`` of this stage's parameters (the last stage's tied copy included, once)."""
        for name, param in self.named_parameters():
            yield self.gpt_name(name), param

    def local_moe_layers(self) -> List[BaseMoELayer]:
        return [m for m in self.modules() if isinstance(m, BaseMoELayer)]

    def destroy_process_groups(self) -> None:
        """Tear down the groups DeepSpeed's ``PipelineModule`` made for itself (``destroy_pipeline_module_groups``)."""
        destroy_pipeline_module_groups(self)


def destroy_pipeline_module_groups(module: PipelineModule) -> None:
    """Tear down the groups a DeepSpeed ``PipelineModule`` made for itself (never freed by DeepSpeed).

    Its grid and tied layers hold copies of our groups' ranks as groups of their own; a process
    that builds several pipeline engines (tests, notebooks) would otherwise keep every one of
    them and their threads alive.  The module is unusable for communication afterwards.
    """
    seen = set()
    for group in release_pipeline_module_groups(module):
        if group is dist.GroupMember.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER or id(group) in seen:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


def check_model_stages(model, pp: int, schedule: str = "1f1b", vpp: int = 1) -> None:
    """The model is split into ``pp`` stages exactly when the config says pp > 1: ``GPTModelChunks`` with ``vpp``
    chunks for our runtime (every schedule), or for "1f1b" a ``PipelineModule`` for DeepSpeed's engine."""
    if isinstance(model, GPTModelChunks):
        if model.num_model_chunks != vpp:
            raise ConfigError(f"the GPTModelChunks holds {model.num_model_chunks} chunks per rank but "
                              f"megatron.virtual_pipeline_model_parallel_size is {vpp}; build it with the same v")
        return
    if pp > 1 and schedule != "1f1b" and isinstance(model, PipelineModule):
        raise ConfigError(f"megatron.pipeline_schedule {schedule!r} runs on ds_megatron's pipeline runtime, which "
                          "takes a GPTModelChunks, not a PipelineModule (DeepSpeed's engine runs \"1f1b\" only); "
                          "build that model (ds-megatron train picks it from the config)")
    stages = model.num_stages if isinstance(model, PipelineModule) else 1
    if pp > 1 and not isinstance(model, PipelineModule):
        raise ConfigError(f"megatron.pipeline_model_parallel_size={pp} needs the model split into stages: pass "
                          "model=ds_megatron.GPTModelChunks(config, parallel_state) (or a deepspeed PipelineModule "
                          "built with topology=ds_megatron.pipeline_topology(parallel_state.layout))")
    if stages != pp:
        raise ConfigError(f"the PipelineModule has {stages} stages but megatron.pipeline_model_parallel_size "
                          f"is {pp}; build it from the same parallel_state")


def prepare_pipeline_module(model, parallel_state: ParallelState, our_buffers: bool = True) -> None:
    """Check a pipeline model against the job's layout and mark its tied weights (before the buffers exist).

    A ``PipelineModule`` must be built on our topology (its groups are ours),
    with as many stages as ``pipeline_model_parallel_size``.  With our gradient
    buffers (``our_buffers``) each tied weight spanning stages must tie the first
    and the last stage (the ``embedding`` group, whose sum ``finalize_model_grads``
    does); DeepSpeed's own reduction sums any tie over its own groups.  The copies
    are marked ``shared_embedding``, and all but the first ``shared`` (counted once in norms).
    """
    check_model_stages(model, parallel_state.layout.pp)
    check_topology_matches(model.topology(), parallel_state)
    pipe = parallel_state.pp.ranks
    embedding = sorted({pipe[0], pipe[-1]})  # this rank's pipeline's embedding group
    for key, ranks, weights in tied_weights(model):
        if len(ranks) < 2:
            continue
        if our_buffers and ranks != embedding:
            raise ConfigError(f"tied layer {key!r} ties ranks {ranks}, not the first and last stage {embedding}; "
                              "ds_megatron sums tied gradients over the embedding group only: tie the first and "
                              "last stage, or untie the layer")
        for weight in weights:
            weight.shared_embedding = True
            weight.shared = parallel_state.pp.rank != 0


def pipeline_deepspeed_config(ds_config):
    """DeepSpeed's ``pipeline`` section with activation partitioning off unless the user turned it on.

    DeepSpeed's default splits each stage's output over the model-parallel ranks
    and regathers it on the next stage; the activations Megatron sends are the
    whole (or, with sequence parallelism, this rank's slice of the) hidden states.
    """
    out = dict(ds_config)
    section = dict(out.get("pipeline", {}))
    section.setdefault("pipe_partitioned", False)
    section.setdefault("grad_partitioned", False)
    out["pipeline"] = section
    return out


def set_routing_loss_scale(model: GPTPipelineModule, optimizer, micro_batches: int) -> None:
    """Routing losses weigh loss scale / micro-batches in backward, as the loss itself does."""
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is None:
        model.set_aux_loss_gradient_scale(lambda: 1.0 / micro_batches)
    else:
        model.set_aux_loss_gradient_scale(lambda: scaler.scale / micro_batches)
