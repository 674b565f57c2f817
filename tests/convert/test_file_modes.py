"""What ``ds-megatron convert`` and ``ds-megatron export-fp32`` write gets the modes the process umask gives.

Directories ``0o777 & ~umask``, files ``0o666 & ~umask``, exactly, whatever the source files' modes: another user (an
inference server) reads what a group- or world-readable umask lets it read.  Before, ``tempfile.mkdtemp`` left a
converted directory 0700 and safetensors' ``save_file`` an exported file 0600.  The writes stay atomic: nothing
but the result is left beside it.
"""
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

import hf_models
from ds_megatron.checkpointing.export_fp32 import save_state_dict
from ds_megatron.cli import main as cli_main

UMASKS = [0o022, 0o077, 0o002]
UMASK_IDS = ["022", "077", "002"]


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root):
    """``path -> permission bits`` of ``root`` and everything under it."""
    out = {root: stat.S_IMODE(os.stat(root).st_mode)}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(parent, name)
            out[path] = stat.S_IMODE(os.stat(path).st_mode)
    return out


def _expected(path, umask):
    return (0o777 if os.path.isdir(path) else 0o666) & ~umask


@pytest.mark.parametrize("umask", UMASKS, indirect=True, ids=UMASK_IDS)
def test_convert_both_ways_follows_the_umask(tmp_path, umask):
    src = hf_models.save(hf_models.make_model("llama", dtype=torch.float32), str(tmp_path / "hf"))
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        f.write("{}")
    for f in os.listdir(src):  # the sources' own modes must not carry over
        os.chmod(os.path.join(src, f), 0o600)
    ours, back = str(tmp_path / "out" / "ours"), str(tmp_path / "out" / "back")
    assert cli_main(["convert", src, ours, "--tp=2", "--pp=2"]) == 0
    assert cli_main(["convert", ours, back]) == 0
    written = {**_modes(ours), **_modes(back)}
    assert os.path.isfile(os.path.join(ours, "hf_files", "tokenizer_config.json"))
    assert os.path.isfile(os.path.join(back, "tokenizer_config.json"))
    assert {p: oct(m) for p, m in written.items()} == {p: oct(_expected(p, umask)) for p in written}
    assert sorted(os.listdir(tmp_path / "out")) == ["back", "ours"]  # no temporary directory left


@pytest.mark.parametrize("umask", UMASKS, indirect=True, ids=UMASK_IDS)
@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_export_fp32_file_follows_the_umask_and_is_replaced_whole(tmp_path, umask, name):
    g = torch.Generator().manual_seed(0)
    state = {"embedding.word_embeddings.weight": torch.randn(11, 4, generator=g),
             "decoder.final_layernorm.weight": torch.randn(4, generator=g), "step": torch.tensor(3)}
    out = str(tmp_path / "export" / name)
    os.makedirs(os.path.dirname(out))
    with open(out, "w") as f:  # an earlier export: replaced, and its mode does not carry over
        f.write("old")
    os.chmod(out, 0o600)
    save_state_dict(state, out)
    assert oct(stat.S_IMODE(os.stat(out).st_mode)) == oct(0o666 & ~umask)
    assert os.listdir(os.path.dirname(out)) == [name]
    back = load_file(out) if name.endswith(".safetensors") else torch.load(out)
    assert sorted(back) == sorted(state)
    for key, t in state.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
