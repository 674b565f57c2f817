"""Samplers: each DP rank's slice of the global batch, disjoint ranks, exact resume."""
import pytest
import torch

from ds_megatron.data.sampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler


def _steps(sampler_cls, dp, total, consumed=0, mbs=3, **kw):
    """Per step, the list of each rank's batch."""
    per_rank = [list(sampler_cls(total, consumed, mbs, r, dp, **kw)) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1
    return list(zip(*per_rank))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_step_union_is_the_global_batch(dp):
    mbs, total = 3, 100
    steps = _steps(MegatronPretrainingSampler, dp, total, mbs=mbs)
    assert len(steps) == total // (mbs * dp)
    for k, ranks in enumerate(steps):
        flat = [i for b in ranks for i in b]
        assert all(len(b) == mbs for b in ranks)
        assert len(set(flat)) == len(flat)  # disjoint across ranks
        assert flat == list(range(k * mbs * dp, (k + 1) * mbs * dp))  # rank r takes slice r


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_continues_the_sequence(dp):
    full = _steps(MegatronPretrainingSampler, dp, 100)
    for done in (0, 1, 3):
        assert _steps(MegatronPretrainingSampler, dp, 100, consumed=done * 3 * dp) == full[done:]


def test_same_dp_rank_same_batch():
    # What a TP rank sees depends on its DP rank alone.
    a = list(MegatronPretrainingSampler(50, 0, 2, 1, 2))
    b = list(MegatronPretrainingSampler(50, 0, 2, 1, 2))
    assert a == b and len(a) == len(MegatronPretrainingSampler(50, 0, 2, 1, 2))


def test_drop_last_false_keeps_the_tail():
    ranks = [list(MegatronPretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in range(2)]
    assert ranks == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    assert [len(MegatronPretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in range(2)] == [3, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples 10 >= total_samples 10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)


def _global_order(total, steps, mbs, dp, consumed=0, seed=7):
    """The random sampler's first ``steps`` global batches, each the ranks' micro-batches in rank order."""
    iters = [iter(MegatronPretrainingRandomSampler(total, consumed, mbs, r, dp, seed=seed)) for r in range(dp)]
    return [[i for it in iters for i in next(it)] for _ in range(steps)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_random_sampler_covers_each_epoch_once(dp):
    mbs, total = 2, 48
    flat = [i for batch in _global_order(total, 3 * total // (mbs * dp), mbs, dp) for i in batch]
    epochs = [flat[e * total:(e + 1) * total] for e in range(3)]
    assert all(sorted(e) == list(range(total)) for e in epochs)  # each sample once per epoch, ranks disjoint
    assert epochs[0] != sorted(epochs[0]) and epochs[0] != epochs[1] != epochs[2]
    for e, order in enumerate(epochs):  # epoch e is the permutation drawn from seed + e
        assert order == torch.randperm(total, generator=torch.Generator().manual_seed(7 + e)).tolist()


def test_random_sampler_order_is_global():
    """The order depends on the dataset and the seed alone: any DP size, any global batch (a batch may straddle
    epochs: 50 is no multiple of 12), any resume point reads the same sample sequence, and it never ends."""
    total = 50
    reference = [i for batch in _global_order(total, 400, 1, 1) for i in batch]  # 8 epochs
    for mbs, dp in ((2, 1), (2, 2), (3, 4), (5, 2)):
        g = mbs * dp
        for consumed in (0, g, 7 * g + 3):
            flat = [i for batch in _global_order(total, 12, mbs, dp, consumed) for i in batch]
            assert flat == reference[consumed:consumed + len(flat)], (mbs, dp, consumed)


def test_build_data_loader_rejects_unknown_type():
    from ds_megatron.data.sampler import build_data_loader
    with pytest.raises(ValueError, match="dataloader_type 'random'"):
        build_data_loader(list(range(10)), 1, 0, 1, dataloader_type="random")
