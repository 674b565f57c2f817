"""`ds-megatron train` with a model whose loss turns infinite after $NONFINITE_AFTER steps (test_guards.py).

Run by a launcher: the CLI's own main, so its exit code is what a cluster would see.
"""
import os
import sys


def infinite_after(base, good_steps: int):
    """A subclass of the GPT class ``base`` whose training loss is multiplied by inf after ``good_steps`` forwards."""

    class InfiniteLater(base):
        calls = 0

        def forward(self, *args, **kwargs):
            loss = super().forward(*args, **kwargs)
            if self.training:
                InfiniteLater.calls += 1
                if InfiniteLater.calls > good_steps:
                    return loss * float("inf")
            return loss

    return InfiniteLater


if __name__ == "__main__":
    import ds_megatron.training.build as build
    from ds_megatron.training.job import main

    build.GPTModel = infinite_after(build.GPTModel, int(os.environ["NONFINITE_AFTER"]))
    sys.exit(main(sys.argv[1:]))
