"""The data side of a training job: tokenizer, Megatron ``.bin``/``.idx`` datasets,
preprocessing, the built-in stdlib corpus, GPT samples and per-DP-rank samplers."""
from .corpus import DEFAULT_MAX_BYTES, build_default_dataset, default_cache_dir
from .gpt_dataset import GPTDataset, build_train_valid_datasets
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from .preprocess import preprocess
from .sampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler, build_data_loader
from .tokenizer import ByteTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer", "build_tokenizer",
    "IndexedDataset", "IndexedDatasetBuilder", "best_dtype",
    "preprocess",
    "DEFAULT_MAX_BYTES", "build_default_dataset", "default_cache_dir",
    "GPTDataset", "build_train_valid_datasets",
    "MegatronPretrainingSampler", "MegatronPretrainingRandomSampler", "build_data_loader",
]
