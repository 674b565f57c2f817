"""An unknown config key is answered in one sentence naming the key it most likely meant, never the list of all.

Every section kind that refuses unknown keys (the top of ``"megatron"``, its nested ``model`` / ``train`` / ``data``
/ ``cuda_graph`` sections, DeepSpeed's ``fp16`` on our optimizer path) goes through ``config.parsing.unknown_key``.
The reference is the typo itself: a key with a letter dropped, its last letter dropped, or in capitals must be
answered with the key it was made from.  Pure Python: the config half is torch-free.
"""
import os
import re

import pytest

from ds_megatron.config import ConfigError, MegatronConfig
from ds_megatron.config.megatron import _NESTED, section_keys
from ds_megatron.config.parsing import KEYS_DOC, field_names
from ds_megatron.config.precision import _FP16_OFF_ONLY, FP16_DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each section kind: the keys it accepts.
SECTIONS = {"megatron": section_keys(), **{f"megatron.{name}": field_names(tp) for name, tp in _NESTED.items()},
            "fp16": ["enabled", *FP16_DEFAULTS, *_FP16_OFF_ONLY]}


def _error(where, key):
    """The ConfigError for ``key`` written into section ``where`` of an otherwise empty config."""
    if where == "megatron":
        section, ds_config = {key: 1}, {}
    elif where == "fp16":
        section, ds_config = {}, {"fp16": {"enabled": True, key: 1}}
    else:
        section, ds_config = {where.split(".", 1)[1]: {key: 1}}, {}
    with pytest.raises(ConfigError) as err:
        MegatronConfig.from_section(section, ds_config)
    return str(err.value)


@pytest.mark.parametrize("where,typed,meant", [
    ("megatron.model", "hiden_size", "hidden_size"),  # the issue's own typo
    ("megatron.model", "Hidden_Size", "hidden_size"),
    ("megatron", "tensor_model_paralel_size", "tensor_model_parallel_size"),
    ("megatron", "overlap_grad_reduction", "overlap_grad_reduce"),
    ("megatron.train", "lr_warmup_iter", "lr_warmup_iters"),
    ("megatron.data", "tokeniser", "tokenizer"),
    ("megatron.cuda_graph", "scopes", "scope"),
    ("fp16", "loss_scale_windows", "loss_scale_window"),
])
def test_a_typo_is_answered_with_the_key_it_meant(where, typed, meant):
    assert _error(where, typed) == f"unknown key {where}.{typed}; did you mean {where}.{meant}?"


def test_every_key_of_every_section_is_found_from_its_typos():
    misses = []
    for where, keys in SECTIONS.items():
        for key in keys:
            for typed in (key[:len(key) // 2] + key[len(key) // 2 + 1:], key[:-1], key.upper()):
                if typed in keys:
                    continue
                message = _error(where, typed)
                named = re.fullmatch(rf"unknown key {re.escape(where)}\.{re.escape(typed)}; did you mean (.*)\?",
                                     message)
                if named is None or f"{where}.{key}" not in named.group(1).split(" or "):
                    misses.append(message)
    assert not misses, misses


def test_equally_likely_keys_are_all_named():
    assert _error("megatron.train", "adam_beta") == ("unknown key megatron.train.adam_beta; did you mean "
                                                     "megatron.train.adam_beta1 or megatron.train.adam_beta2?")


def test_a_key_close_to_none_points_at_the_reference_instead_of_listing_the_keys():
    message = _error("megatron.model", "rope_theta")
    assert message == f"unknown key megatron.model.rope_theta; {KEYS_DOC} lists every key of megatron.model"
    with open(os.path.join(ROOT, KEYS_DOC)) as f:
        doc = f.read()
    assert "`megatron.model.hidden_size`" in doc and "`fp16.loss_scale_window`" in doc
    assert len(_error("megatron", "zzz")) < 100  # the old message listed all 76 model keys (1.6 KB)


def test_a_nested_key_written_at_the_top_is_sent_where_it_belongs():
    assert _error("megatron", "num_layers") == ("unknown key megatron.num_layers; it is a key of megatron.model: "
                                                "move it there")
    assert _error("megatron", "lr_warmup_iters") == ("unknown key megatron.lr_warmup_iters; it is a key of "
                                                     "megatron.train: move it there")
