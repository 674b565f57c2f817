"""``ds-megatron plan`` for the fp8 settings it counted last (``planning.memory``'s fp8 functions) against what real
ranks allocate: the delayed recipe's amax histories and scales, to the byte."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_on_ranks

from ds_megatron.config.model import GPTConfig
from ds_megatron.fp8 import delayed_scaling_groups, update_delayed_scaling
from ds_megatron.models.gpt import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.planning.memory import plan_memory
from ds_megatron.tensor_parallel.layers import fp8_states
from ds_megatron.utils.memory import peak_allocated_bytes

# Three layers, the first in bf16, and a multi-token-prediction layer (past the last layer: bf16 under
# first_last_layers_bf16): the count follows fp8_layer.
DELAYED = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
               make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, fp8="hybrid",
               first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0,
               mtp_num_layers=1, fp8_amax_history_len=5)


def _built_and_stepped_bytes(tp: int, recipe: str):
    """What building the model allocates and keeps (its parameters and, delayed, the linears' scaling state), and
    the bytes its scaling states hold after two steps (forward, backward, ``update_delayed_scaling``)."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp))
    torch.manual_seed(0)
    cfg = GPTConfig(**DELAYED, fp8_recipe=recipe)
    _, built, model = peak_allocated_bytes(lambda: GPTModel(cfg, state))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        update_delayed_scaling(fp8_states(model), delayed_scaling_groups(state))
    held = sum(t.numel() * t.element_size() for s in fp8_states(model) if s.recipe.recipe == "delayed"
               for d in (s.amax_history, s.scale, s.step_amax) for t in d.values())
    state.destroy()
    return built, held


def test_delayed_recipes_amax_histories_and_scales_are_planned_to_the_byte():
    """Per fp8 linear (QKV, projection, fc1, fc2 of layers 1 and 2) and role, an fp32 history of
    ``fp8_amax_history_len``, a scale and the step's running amax: the model built with the delayed recipe holds
    exactly the planned bytes more than with tensorwise, and its states hold them still after two steps."""
    tp = 2
    layout = ParallelLayout(world_size=2, tp=tp)
    planned = plan_memory(GPTConfig(**DELAYED, fp8_recipe="delayed"), layout, "bf16")[0].fp8_scaling_bytes
    assert planned == 2 * 4 * 3 * (5 + 2) * 4
    assert plan_memory(GPTConfig(**DELAYED), layout, "bf16")[0].fp8_scaling_bytes == 0
    delayed = run_on_ranks(2, _built_and_stepped_bytes, tp, "delayed")
    tensorwise = run_on_ranks(2, _built_and_stepped_bytes, tp, "tensorwise")
    for (built, held), (built_tw, _) in zip(delayed, tensorwise):
        assert built - built_tw == planned, (built, built_tw, planned)
        assert held == planned, (held, planned)
