"""The data side of a training job (import the modules themselves).

| module | concept |
| --- | --- |
| ``tokenizer`` | the byte tokenizer (and the names config validation checks against) |
| ``indexed_dataset`` | Megatron-compatible ``.bin`` / ``.idx`` token files (numpy, no torch) |
| ``preprocess`` | ``ds-megatron preprocess``: text / JSONL into ``.bin`` / ``.idx``; ``--sft`` reads chat rows |
| ``workers`` | encoding inputs in worker processes, in input order, errors raised at their input's place |
| ``sft`` | packed SFT datasets: chat rows into tokens and trained flags (chat templates), best-fit-decreasing packing, the files |
| ``sft_dataset`` | SFT samples over packed rows: per-document positions, loss on the trained tokens |
| ``collator`` | ``PackedCollator``: a user loop's tokenized examples packed into rows (padding-free, per-example positions) |
| ``corpus`` | the embedded default corpus: the running Python's standard-library sources |
| ``gpt_dataset`` | fixed-length GPT samples over document splits |
| ``blended_dataset`` | Megatron's blends: blending indices, their cache, ``BlendedDataset`` |
| ``sampler`` | Megatron's per-DP-rank batch samplers and the data loader |

This file imports nothing, so the torch-free modules (tokenizer, indexed
dataset, preprocessing, sft, workers) stay torch-free for the config checks and the CLI.
"""
