"""The MoE forward and backward wait for the device only where the design says: the dispatcher's sync point.

A host sync (reading a device value from Python: ``.item()``, ``float()``,
``.tolist()``, ``.cpu()``, a data-dependent shape such as ``nonzero``, or a
host list copied to the device) stalls a GPU pipeline in every MoE layer and
is illegal inside a CUDA graph capture.  On a CPU nothing stalls, so the
calls themselves are counted: the same code runs on both.  Megatron's design
has exactly one per MoE layer and forward, the all-to-all dispatcher's copy of
the split sizes at its ``cuda_sync_point`` (the all-gather dispatcher's
per-expert counts); the routing-loss tracker keeps its values on the device.
"""
import collections
import contextlib

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from host_reads import TENSOR_METHODS, TORCH_FUNCTIONS
from moe_helpers import MOE, moe_config
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState



@contextlib.contextmanager
def count_host_syncs():
    """Counter of the calls that read device data from the host (or copy host data to the device)."""
    calls = collections.Counter()
    saved = []

    def wrap(owner, name, counted=None):
        original = getattr(owner, name)

        def spy(*args, **kwargs):
            if counted is None or counted(*args, **kwargs):
                calls[name] += 1
            return original(*args, **kwargs)
        saved.append((owner, name, original))
        setattr(owner, name, spy)

    for name in TENSOR_METHODS:
        wrap(torch.Tensor, name)
    for name in TORCH_FUNCTIONS:
        wrap(torch, name)
    # repeat_interleave with tensor repeats needs the output size from the device unless it is given.
    wrap(torch, "repeat_interleave",
         lambda x, repeats=None, *a, output_size=None, **k: torch.is_tensor(repeats) and output_size is None)
    try:
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _forward_backward_syncs(tp=1, ep=1, **overrides):
    state = None
    if dist.is_initialized():
        state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep))
    torch.manual_seed(3)
    config = moe_config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_shared_expert_ffn_hidden_size=16,
                        **overrides)
    model = GPTModel(config, state)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g)
    labels = torch.randint(0, MOE["vocab_size"], (2, MOE["seq_length"]), generator=g)
    model(tokens, labels).backward()  # warm-up: lazy initialization is not what is counted
    with count_host_syncs() as forward_calls:
        loss = model(tokens, labels)
        model.moe_aux_loss_tracker.averages()
    with count_host_syncs() as backward_calls:
        loss.backward()
    if state is not None:
        state.destroy()
    return dict(forward_calls), dict(backward_calls)


@pytest.mark.parametrize("grouped", [False, True])
def test_alltoall_moe_forward_syncs_once_per_layer_and_backward_never(grouped):
    forward_calls, backward_calls = _forward_backward_syncs(moe_grouped_gemm=grouped)
    assert forward_calls == {"tolist": MOE["num_layers"]}, forward_calls
    assert backward_calls == {}, backward_calls


def test_allgather_dispatcher_syncs_once_per_layer():
    forward_calls, backward_calls = _forward_backward_syncs(moe_token_dispatcher_type="allgather")
    assert forward_calls == {"tolist": MOE["num_layers"]}, forward_calls
    assert backward_calls == {}, backward_calls


def test_expert_parallel_forward_syncs_once_per_layer():
    for forward_calls, backward_calls in run_on_ranks(2, _forward_backward_syncs, 1, 2):
        assert forward_calls == {"tolist": MOE["num_layers"]}, forward_calls
        assert backward_calls == {}, backward_calls


def test_the_tracker_keeps_losses_on_the_device():
    from ds_megatron.moe import MoEAuxLossTracker
    tracker = MoEAuxLossTracker()
    with count_host_syncs() as calls:
        for layer in range(3):
            for step in range(2):
                tracker.record("z_loss", layer, torch.tensor(float(layer + step)))
        averages = tracker.averages()
    assert calls["item"] == calls["__float__"] == calls["tolist"] == 0
    assert isinstance(averages["z_loss"], torch.Tensor)
    assert float(averages["z_loss"]) == pytest.approx(0.5 + 1.5 + 2.5)
