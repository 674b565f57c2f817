"""The README's embedding example, run as written (loader replaced by fixed batches) on 4 ranks."""
import os
import re

import torch

from harness import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_snippet():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Using it in a DeepSpeed project.*?```python\n(.*?)```", text, re.S).group(1)
    return block.replace("ds_configs/", os.path.join(ROOT, "ds_configs") + "/")


def _run_snippet():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (8, 129), generator=g)
    loader = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}] * 6
    scope = {"loader": loader}
    losses = []
    code = _readme_snippet().replace("    engine.step()", "    engine.step()\n    losses.append(float(loss))")
    scope["losses"] = losses
    exec(compile(code, "README.md", "exec"), scope)
    scope["engine"].megatron.state.destroy()
    return losses, scope["engine"].megatron.state.layout.tp


def test_readme_embedding_example_trains():
    for losses, tp in run_on_ranks(4, _run_snippet):
        assert tp == 2
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.5  # the same batch again and again: it must fit
