"""Training checkpoints: how an engine's training state is saved, found and read back (``api`` is the entry).

| module | concern |
| --- | --- |
| ``api`` | the facade: ``save`` / ``load`` / ``latest`` / ``prune`` of a run directory; the public save / load |
| ``run_dir`` | tags, ``latest`` (atomic rename), pruning, the job's record, the ``--resume`` checks (torch-free) |
| ``deepspeed_format`` | DeepSpeed's files plus our experts, MoE optimizer states and the export record |
| ``torch_dist`` | the layout-independent format (``torch.distributed.checkpoint``) |
| ``global_shards`` | where each of a rank's tensors lies in the one-rank model (torch-free) |
| ``rng`` | each rank's random-number state |
| ``export_fp32`` | ``ds-megatron export-fp32``: any checkpoint as one fp32 state dict of ``GPTModel`` |
| ``pretrained`` | ``ds_megatron.from_pretrained``: this rank's model built from a Hugging Face or converted directory |

Importing this package imports nothing, so the torch-free ``run_dir`` stays torch-free.  Hugging Face
conversion lives in ``ds_megatron.convert``.
"""
