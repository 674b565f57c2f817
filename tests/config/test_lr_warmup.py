"""A warmup the schedule cannot finish is said at start, in one line naming both fields and the fix: refused when
it outlasts ``lr_decay_iters`` (an inconsistent schedule), a notice when it outlasts the run (a short trial run may
mean it).

The reference is the schedule itself (``training.lr_schedule.lr_at``, what the job's scheduler runs): ``load_job``
speaks exactly when, over the steps up to where the schedule ends (``lr_decay_iters``, else the run's
``train_iters``), the learning rate never reaches ``lr``.  ``--train-iters`` (``load_job``'s ``train_iters``)
replaces the config's value before the check.  With DeepSpeed's own ``optimizer`` / ``scheduler`` sections the
``megatron.train`` schedule does not run, and its default warmup is not held against a short run.
"""
import math

import pytest

from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.training.lr_schedule import lr_at

LR = 3e-3


def _config(train_iters, warmup, decay_iters=None, **extra):
    train = {"train_iters": train_iters, "lr": LR, "min_lr": 3e-4, "lr_warmup_iters": warmup}
    if decay_iters is not None:
        train["lr_decay_iters"] = decay_iters
    return {"train_micro_batch_size_per_gpu": 2, **extra,
            "megatron": {"model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2}, "train": train}}


def _said(cfg, **kwargs):
    """The job's warmup notice, or the ConfigError's text."""
    try:
        notices = [n for n in load_job(cfg, 1, **kwargs).megatron.notices if "lr_warmup_iters" in n]
    except ConfigError as e:
        return str(e)
    return notices[0] if notices else None


def _reaches_peak(train_iters, warmup, decay_iters):
    end = decay_iters if decay_iters is not None else train_iters
    return any(math.isclose(lr_at(step, LR, 3e-4, warmup, end), LR, rel_tol=1e-12) for step in range(end))


@pytest.mark.parametrize("decay_iters", [None, 2, 5])
def test_said_exactly_when_the_schedule_never_reaches_lr(decay_iters):
    for train_iters in range(1, 7):
        for warmup in range(0, 8):
            cfg = _config(train_iters, warmup, decay_iters)
            if _reaches_peak(train_iters, warmup, decay_iters):
                assert _said(cfg) is None
            elif decay_iters is None:
                assert _said(cfg).startswith("note: megatron.train.lr_warmup_iters=")
            else:
                with pytest.raises(ConfigError, match=r"^megatron\.train\.lr_warmup_iters="):
                    load_job(cfg, 1)


def test_the_message_names_both_fields_and_the_fix():
    assert _said(_config(10, 20)) == (
        "note: megatron.train.lr_warmup_iters=20 is longer than the run (megatron.train.train_iters=10), so the learning "
        "rate never reaches megatron.train.lr; lower lr_warmup_iters to at most 10, train longer, or set "
        "megatron.train.lr_decay_iters to the length of the whole schedule this run starts")
    with pytest.raises(ConfigError) as err:
        load_job(_config(100, 20, decay_iters=10), 1)
    assert str(err.value) == ("megatron.train.lr_warmup_iters=20 exceeds megatron.train.lr_decay_iters=10: the decay "
                              "would end before the warmup does; lower lr_warmup_iters to at most 10 or raise "
                              "lr_decay_iters")


def test_train_iters_from_the_command_line_is_checked_too():
    cfg = _config(300, 20)
    assert "lr_warmup_iters=20 is longer than the run (--train-iters 10), " in _said(cfg, train_iters=10)
    assert load_job(cfg, 1, train_iters=20).train.train_iters == 20
    assert load_job(_config(10, 20), 1, train_iters=30).train.train_iters == 30  # the override lengthens the run
    # The start of a longer schedule (Megatron's --lr-decay-iters): the warmup may outlast this run.
    assert load_job(_config(300, 20, decay_iters=300), 1, train_iters=10).train.train_iters == 10


def test_deepspeeds_own_schedule_is_not_held_to_the_megatron_train_warmup():
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    for extra in (adam, {**adam, **warmup}, warmup):
        cfg = _config(5, 0, **extra)
        del cfg["megatron"]["train"]["lr_warmup_iters"], cfg["megatron"]["train"]["lr"]
        del cfg["megatron"]["train"]["min_lr"]
        assert load_job(cfg, 1).train.lr_warmup_iters == 20  # the default, unused: said with our schedule
        assert _said(cfg) is None
        assert "lr_warmup_iters=20 is longer than the run" in _said({k: v for k, v in cfg.items() if k not in extra})
