"""`ds-megatron train` with a model whose loss turns infinite after $NONFINITE_AFTER steps (test_guards.py).

Run by a launcher: the CLI's own main, so its exit code is what a cluster would see.
"""
import os
import sys

import ds_megatron.training.train as loop
from ds_megatron.training.job import main


class InfiniteLater(loop.GPTModel):
    calls = 0

    def forward(self, *args, **kwargs):
        loss = super().forward(*args, **kwargs)
        if self.training:
            InfiniteLater.calls += 1
            if InfiniteLater.calls > int(os.environ["NONFINITE_AFTER"]):
                return loss * float("inf")
        return loss


loop.GPTModel = InfiniteLater
sys.exit(main(sys.argv[1:]))
