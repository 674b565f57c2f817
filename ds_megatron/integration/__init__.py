"""Every DeepSpeed seam of ds_megatron, in one package (nothing else in the package imports DeepSpeed).

| module | seam |
| --- | --- |
| ``engine`` | ``deepspeed.initialize`` behind ``ds_megatron.initialize``; ``engine.megatron`` |
| ``mpu`` | ``MegatronMPU``: the object DeepSpeed is handed as ``mpu=`` |
| ``optimizer`` | the client-optimizer contract (``overflow``, ``_global_grad_norm``, ``step``), the config DeepSpeed sees |
| ``gradients`` | DeepSpeed's own reduction switched off (``enable_backward_allreduce``); our buffers driven per micro-batch |
| ``moe`` | DeepSpeed's expert-group tables and expert checkpoint file names |
| ``checkpoint`` | ``save_checkpoint`` / ``load_checkpoint`` around the engine's own |
| ``rng`` | our RNG tracker handed to DeepSpeed's activation checkpointing |
| ``cuda_graphs`` | the engine forward hook that captures and replays CUDA graphs |
| ``runtime`` | starting DeepSpeed's comm layer; the CPU accelerator's workarounds |

``ARCHITECTURE.md`` lists each seam with the DeepSpeed source line it relies on.
The DeepSpeed version is checked once, here, at import.
"""
import warnings

import deepspeed

# The versions whose internals the seams were read from and tested against.
TESTED_DEEPSPEED = ("0.19",)
MIN_DEEPSPEED = (0, 16)


def _check_deepspeed_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_DEEPSPEED:
        raise ImportError(f"ds_megatron needs DeepSpeed >= {'.'.join(map(str, MIN_DEEPSPEED))}, found {version}; "
                          "pip install 'deepspeed>=0.19,<0.20'")
    if not version.startswith(TESTED_DEEPSPEED):
        warnings.warn(f"ds_megatron was tested with DeepSpeed {', '.join(v + '.x' for v in TESTED_DEEPSPEED)}, this "
                      f"is {version}: the seams listed in ARCHITECTURE.md may have moved; run the test suite",
                      stacklevel=2)


_check_deepspeed_version(deepspeed.__version__)
