"""``ds-megatron train``: a GPT training job through the plain DeepSpeed loop.

| module | phase |
| --- | --- |
| ``job`` | the command line: the config checked (torch-free), then the loop loaded |
| ``build`` | groups, model, optimizer, engine, data |
| ``steps`` | one step and one evaluation, for the plain loop and for the pipeline engine |
| ``train`` | the loop as named phases over one running state (``Trainer``) |
| ``monitoring``, ``metrics`` | what is reported, where, and the non-finite guard |
| ``signals`` | stopping gracefully on a signal or schedule |
| ``lr_schedule`` | Megatron's warmup + decay |

Checkpoints are ``ds_megatron.checkpointing``'s; the job's config is ``ds_megatron.config.job``'s.
"""
