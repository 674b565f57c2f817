"""Samplers: each DP rank's slice of the global batch, disjoint ranks, exact resume."""
import pytest

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


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_random_sampler_disjoint_and_covering(dp):
    mbs, total = 2, 50
    steps = _steps(MegatronPretrainingRandomSampler, dp, total, mbs=mbs, seed=7)
    flat = [i for ranks in steps for b in ranks for i in b]
    active = total - total % (mbs * dp)
    assert sorted(flat) == list(range(active))  # each sample once per epoch, ranks disjoint
    if dp == 1:
        assert flat != sorted(flat)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_random_sampler_resume_and_epochs(dp):
    mbs, total = 2, 48
    samplers = [MegatronPretrainingRandomSampler(total, 0, mbs, r, dp, seed=7) for r in range(dp)]
    epoch0 = list(zip(*[list(s) for s in samplers]))
    epoch1 = list(zip(*[list(s) for s in samplers]))
    assert epoch0 != epoch1 and all(s.consumed_samples == 2 * total for s in samplers)
    history = epoch0 + epoch1
    steps_per_epoch = total // (mbs * dp)
    for done in (1, steps_per_epoch, steps_per_epoch + 2):
        resumed = [MegatronPretrainingRandomSampler(total, done * mbs * dp, mbs, r, dp, seed=7) for r in range(dp)]
        got = list(zip(*[list(s) for s in resumed]))
        end = steps_per_epoch if done < steps_per_epoch else 2 * steps_per_epoch
        assert got == history[done:end]


def test_random_sampler_needs_a_full_batch():
    with pytest.raises(ValueError, match="smaller than one global batch"):
        MegatronPretrainingRandomSampler(3, 0, 2, 0, 2)


def test_build_data_loader_rejects_unknown_type():
    from ds_megatron.data.sampler import build_data_loader
    with pytest.raises(ValueError, match="dataloader_type 'random'"):
        build_data_loader(list(range(10)), 1, 0, 1, dataloader_type="random")
