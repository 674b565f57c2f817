"""The model-parallel RNG tracker: dropout inside fork() differs across TP
ranks and is shared across data-parallel replicas; outside it is identical on
every TP rank; states round-trip for checkpointing and recomputation."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_on_ranks
from tp_helpers import all_gather_cat, tp_group
from ds_megatron.tensor_parallel import RNGStatesTracker, get_cuda_rng_tracker, get_rng_tracker, model_parallel_seed

N = 256


def _mask():
    return F.dropout(torch.ones(N), p=0.5, training=True)


def _masks(tp):
    with tp_group(tp) as (g, r, n):
        tracker = RNGStatesTracker(device="cpu")
        model_parallel_seed(1234, tp_rank=r, tracker=tracker)
        outside = _mask()
        before_fork = torch.get_rng_state()
        with tracker.fork():
            inside = _mask()
        assert torch.equal(torch.get_rng_state(), before_fork), "fork() moved the default generator"
        outside_after = _mask()

        # Round trip: saved states replay the same masks (activation recomputation, checkpoints).
        saved, saved_default = tracker.get_states(), torch.get_rng_state()
        with tracker.fork():
            again = _mask()
        extra = _mask()
        tracker.set_states(saved)
        torch.set_rng_state(saved_default)
        with tracker.fork():
            replay = _mask()
        assert torch.equal(again, replay), "set_states(get_states()) did not replay the fork() stream"
        assert torch.equal(_mask(), extra), "default stream did not replay"
        assert not torch.equal(again, inside), "fork() stream did not advance"

        tp_in = all_gather_cat(inside[None], g, 0)
        tp_out = all_gather_cat(torch.stack([outside, outside_after]), g, 0)
        world_in = all_gather_cat(inside[None], dist.group.WORLD, 0)
        return r, tp_in, tp_out, world_in


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_dropout_masks_inside_and_outside_tp_regions(world, tp):
    results = run_on_ranks(world, _masks, tp)
    r, tp_in, tp_out, world_in = results[0]
    for k in range(1, tp):
        assert not torch.equal(tp_in[0], tp_in[k]), f"TP ranks 0 and {k} drew the same mask inside fork()"
    for k in range(1, tp):
        assert torch.equal(tp_out[0:2], tp_out[2 * k:2 * k + 2]), "masks outside fork() differ across TP ranks"
    # Ranks with the same TP rank (data-parallel replicas) share the model-parallel stream.
    tp_rank_of = [res[0] for res in results]
    for a in range(world):
        for b in range(world):
            same = torch.equal(world_in[a], world_in[b])
            assert same == (tp_rank_of[a] == tp_rank_of[b]), (a, b, tp_rank_of)


def test_seeds_follow_megatron_offsets():
    tracker = RNGStatesTracker(device="cpu")
    model_parallel_seed(7, tp_rank=1, pp_rank=2, tracker=tracker)
    default = _mask()
    with tracker.fork():
        inside = _mask()
    torch.manual_seed(7 + 100 * 2)
    assert torch.equal(default, _mask()), "default stream must be seeded with seed + 100 * pp_rank"
    torch.manual_seed(7 + 200 + 2718 + 1)
    assert torch.equal(inside, _mask()), "model-parallel stream must be seeded with that + 2718 + tp_rank"
    model_parallel_seed(7, tp_rank=1, pp_rank=3, tracker=tracker)
    assert not torch.equal(default, _mask()), "pipeline stages must get different default streams"


def test_tracker_refuses_misuse():
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already tracked"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' is already tracked"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="'model-parallel-rng' is not tracked"):
        with tracker.fork():
            pass
    tracker.reset()
    tracker.add("a", 1)  # reset forgets names and seeds
    assert get_cuda_rng_tracker() is get_rng_tracker()


def test_deepspeed_activation_checkpointing_replays_fork_streams_with_our_tracker():
    """DeepSpeed's recomputation saves and restores the tracker it finds in its
    checkpointing module; with ours installed there (``ds_megatron.initialize``
    does), recomputed dropout inside fork() matches the original forward
    (gradients equal to no checkpointing).  With DeepSpeed's own tracker, or
    under torch's checkpoint (reentrant or not), the rerun would draw other
    masks from our stream: its backward is refused, not a wrong gradient."""
    import functools
    import torch.utils.checkpoint
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt
    tracker = RNGStatesTracker(device="cpu")

    def block(x):
        x = F.dropout(x, 0.5, training=True)
        with tracker.fork():
            x = F.dropout(x * 2.0, 0.5, training=True)
        return x * 3.0

    def grads(checkpoint=None, fn=block):
        model_parallel_seed(5, tp_rank=1, tracker=tracker)
        x = torch.randn(N, requires_grad=True)
        y = checkpoint(fn, x) if checkpoint else fn(x)
        (y * torch.arange(float(N))).sum().backward()
        return x.grad

    plain = grads()
    foreign = [ds_ckpt.checkpoint] + [functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=r)
                                      for r in (True, False)]
    for checkpoint in foreign:  # DeepSpeed's own tracker does not know our stream, nor does torch
        with pytest.raises(RuntimeError, match="recompute_granularity"):
            grads(checkpoint)
    saved = ds_ckpt._CUDA_RNG_STATE_TRACKER
    ds_ckpt._CUDA_RNG_STATE_TRACKER = tracker
    try:
        assert torch.equal(grads(ds_ckpt.checkpoint), plain)
    finally:
        ds_ckpt._CUDA_RNG_STATE_TRACKER = saved
    # Nothing drawn from our stream in the rerun (dropout outside fork only): every checkpoint is right.
    def outside(x):
        return F.dropout(x * 2.0, 0.5, training=True) * 3.0
    plain = grads(fn=outside)
    for checkpoint in foreign:
        assert torch.equal(grads(checkpoint, outside), plain)
