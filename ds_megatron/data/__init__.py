"""The data side of a training job: tokenizer, Megatron ``.bin``/``.idx`` datasets,
preprocessing, the built-in stdlib corpus, GPT samples and per-DP-rank samplers.

Names are imported on first use, so that config validation can read the pure
modules (tokenizer names, dataset files) without importing torch.
"""
import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizer", "build_tokenizer": "tokenizer",
    "IndexedDataset": "indexed_dataset", "IndexedDatasetBuilder": "indexed_dataset", "best_dtype": "indexed_dataset",
    "preprocess": "preprocess",
    "DEFAULT_MAX_BYTES": "corpus", "build_default_dataset": "corpus", "default_cache_dir": "corpus",
    "GPTDataset": "gpt_dataset", "build_train_valid_datasets": "gpt_dataset",
    "MegatronPretrainingSampler": "sampler", "MegatronPretrainingRandomSampler": "sampler",
    "build_data_loader": "sampler",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
