"""Every DeepSpeed seam of ds_megatron, in one package (nothing else in the package imports DeepSpeed).

| module | concern |
| --- | --- |
| ``seams`` | every private DeepSpeed name we read, write, wrap or replace, as named accessors, and their check |
| ``engine`` | ``ds_megatron.initialize``: ``deepspeed.initialize`` with our groups, mpu, optimizer path |
| ``mpu`` | ``MegatronMPU``: the object DeepSpeed is handed as ``mpu=`` |
| ``optimizer`` | what DeepSpeed is handed on our optimizer path (cast model, grad buffers, wrapped optimizer, config) |
| ``gradients`` | exactly one gradient reducer per path, driven per micro-batch inside the engine |
| ``moe`` | MoE layers (ours and DeepSpeed's) and DeepSpeed's expert groups |
| ``pipeline`` | ``GPTPipelineModule`` and the topology: our groups as DeepSpeed's pipeline grid |
| ``pipeline_runtime`` | ``engine.train_batch`` / ``eval_batch`` of our pipeline schedule over ``GPTModelChunks`` |
| ``cuda_graphs`` | the engine forward hook that captures and replays CUDA graphs |
| ``runtime`` | starting DeepSpeed's comm layer; the accelerator's device |
| ``local_job`` | N local ranks for benchmarks and tests (torch-free at import) |

Importing this package imports nothing; the DeepSpeed version is checked by ``seams`` when DeepSpeed loads.
"""
