"""The ``megatron.train`` and ``megatron.data`` sections of a job config (pure, no torch).

Read by ``ds-megatron train``; a bad value fails before anything heavy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..data.indexed_dataset import dataset_exists, max_token_id, token_dtype_code
from ..data.tokenizer import build_tokenizer, is_byte
from ..errors import ConfigError
from .parsing import SECTION


CKPT_FORMATS = ("deepspeed", "torch_dist")


@dataclass
class TrainConfig:
    train_iters: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 20
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    eval_interval: int = 50
    eval_iters: int = 10
    save_interval: int = 0  # 0: only at the end
    log_interval: int = 1
    seed: int = 1234
    output_dir: str = "runs/default"
    # Only the newest N checkpoints are kept (0: all); the one `latest` names is never removed.
    keep_last_n_checkpoints: int = 0
    # Graceful stop (Megatron's names): on SIGTERM / SIGUSR1, every exit_interval steps, or after
    # exit_duration_in_mins, every rank stops at the same step boundary, saves, flushes and exits 0.
    exit_signal_handler: bool = True
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    # Megatron's switch: a non-finite loss (or, outside fp16 loss scaling, a step skipped for
    # non-finite gradients) in this many consecutive steps stops the job with exit code 3.
    check_for_nan_in_loss_and_grad: bool = True
    max_consecutive_nonfinite_steps: int = 1
    # A Hugging Face directory (or one `ds-megatron convert` wrote) to start from: the model section comes from
    # its config, each rank loads its own shards, and every checkpoint also holds the model in our layout
    # (`iter_*/ds_megatron_model`, which `ds-megatron convert` exports back to Hugging Face).
    load_hf: Optional[str] = None
    # A job trained from scratch whose model a Hugging Face family expresses exactly ("llama", "mistral",
    # "qwen2"): every checkpoint also holds `iter_*/ds_megatron_model` for `ds-megatron convert`, as with load_hf.
    export_hf_family: Optional[str] = None
    # Megatron's name.  "torch_dist": torch.distributed.checkpoint, every tensor by its offsets in the whole
    # model, resumable at any TP / PP / EP / ETP / DP (checkpointing/torch_dist.py).  "deepspeed": DeepSpeed's
    # save_checkpoint files (resumable at the same TP / PP / EP sizes, any DP).  null: torch_dist on our
    # optimizer path, deepspeed on DeepSpeed's (config/megatron.py decides).  --resume reads either.
    ckpt_format: Optional[str] = None
    # Megatron's --distributed-timeout-minutes: how long any collective waits for a peer before the rank fails
    # (torch.distributed's default is 30 minutes; a node cut off sends nothing, so this bounds the wait).
    collective_timeout_minutes: float = 10.0

    def __post_init__(self):
        if not (isinstance(self.collective_timeout_minutes, (int, float)) and self.collective_timeout_minutes > 0):
            raise ConfigError(f"{SECTION}.train.collective_timeout_minutes must be > 0, "
                              f"got {self.collective_timeout_minutes!r}")
        if self.ckpt_format is not None and self.ckpt_format not in CKPT_FORMATS:
            raise ConfigError(f"{SECTION}.train.ckpt_format {self.ckpt_format!r} is unknown; use "
                              f"{' or '.join(repr(f) for f in CKPT_FORMATS)}")
        for name in ("train_iters", "eval_interval", "eval_iters", "log_interval", "max_consecutive_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{SECTION}.train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr_warmup_iters", "save_interval", "keep_last_n_checkpoints"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{SECTION}.train.{name} must be >= 0, got {getattr(self, name)}")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise ConfigError(f"{SECTION}.train.exit_interval must be >= 1 (steps) or null, got {self.exit_interval}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ConfigError(f"{SECTION}.train.exit_duration_in_mins must be > 0 or null, "
                              f"got {self.exit_duration_in_mins}")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"{SECTION}.train.lr_decay_style {self.lr_decay_style!r} is unknown; "
                              "use cosine, linear or constant")
        if not self.lr > 0:
            raise ConfigError(f"{SECTION}.train.lr must be > 0, got {self.lr} (the schedule is relative to it)")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{SECTION}.train.min_lr={self.min_lr} must be in [0, lr={self.lr}]")


@dataclass
class DataConfig:
    # Prefix of a .bin/.idx pair from `ds-megatron preprocess`; None: the embedded stdlib corpus.
    data_path: Optional[str] = None
    split: str = "98,2"
    # "byte", or a Hugging Face tokenizer.json file / transformers tokenizer directory (Megatron's
    # HuggingFaceTokenizer); eod_token: the token ending a document when its tokenizer_config.json names no eos_token.
    tokenizer: str = "byte"
    eod_token: Optional[str] = None
    # Megatron's spelling of the same: tokenizer_type "HuggingFaceTokenizer" with tokenizer_model PATH.
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    default_corpus_bytes: int = 4 * 1024 * 1024
    num_workers: int = 0
    dataloader_type: str = "single"

    def __post_init__(self):
        where = f"{SECTION}.data"
        if self.data_path is not None and not dataset_exists(self.data_path):
            raise ConfigError(f"{where}.data_path={self.data_path!r} has no {self.data_path}.bin / .idx; make them "
                              "with `ds-megatron preprocess --input FILE --output-prefix PREFIX`, or drop data_path "
                              "to train on the built-in corpus")
        if self.data_path is not None:
            try:
                token_dtype_code(self.data_path)
            except ValueError as e:
                raise ConfigError(f"{where}.data_path={self.data_path!r}: {e}") from None
        if self.tokenizer_type is not None or self.tokenizer_model is not None:
            self._megatron_tokenizer_names()
        self.build_tokenizer()  # a missing or unreadable tokenizer fails here, naming the field
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"{where}.dataloader_type={self.dataloader_type!r} is unknown; use single or cyclic")
        if self.num_workers < 0:
            raise ConfigError(f"{where}.num_workers must be >= 0, got {self.num_workers}")

    def _megatron_tokenizer_names(self) -> None:
        """tokenizer_type / tokenizer_model (Megatron's names) onto ``tokenizer``; one spelling per config."""
        where = f"{SECTION}.data"
        if self.tokenizer != "byte":
            raise ConfigError(f"{where}.tokenizer and {where}.tokenizer_type / tokenizer_model are both set; keep "
                              "one spelling (tokenizer: PATH, or tokenizer_type \"HuggingFaceTokenizer\" with "
                              "tokenizer_model: PATH)")
        if self.tokenizer_type != "HuggingFaceTokenizer" or not self.tokenizer_model:
            raise ConfigError(f"{where}.tokenizer_type={self.tokenizer_type!r} with tokenizer_model="
                              f"{self.tokenizer_model!r}: the supported Megatron tokenizer is tokenizer_type "
                              "\"HuggingFaceTokenizer\" with tokenizer_model a tokenizer.json file or tokenizer "
                              f"directory (or set {where}.tokenizer)")
        self.tokenizer, self.tokenizer_type, self.tokenizer_model = self.tokenizer_model, None, None

    def build_tokenizer(self):
        """The configured tokenizer, or a ConfigError naming ``data.tokenizer`` / ``data.eod_token``."""
        where = f"{SECTION}.data"
        try:
            return build_tokenizer(self.tokenizer, self.eod_token, field=f"{where}.tokenizer",
                                   eod_field=f"{where}.eod_token")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the job can read is below ``vocab_size`` (model.vocab_size); else a ConfigError with both.

        An id at or above it has no logit: its loss is infinite at every step.  The tokenizer's ids are
        checked when it tokenizes the built-in corpus or is a Hugging Face one (a data_path made with it); the
        dataset's largest id comes from its ``.stats.json`` (written by ``preprocess``) or is read from the ``.bin``.
        """
        where = f"{SECTION}.data"
        if self.data_path is None or not is_byte(self.tokenizer):
            ids = self.build_tokenizer().vocab_size
            if ids > vocab_size:
                raise ConfigError(f"{where}.tokenizer={self.tokenizer!r} has {ids} token ids but "
                                  f"{SECTION}.model.vocab_size={vocab_size}; set vocab_size to at least {ids}")
        if self.data_path is None:
            return
        largest = max_token_id(self.data_path)
        if largest >= vocab_size:
            raise ConfigError(f"{where}.data_path={self.data_path!r} holds token id {largest} but "
                              f"{SECTION}.model.vocab_size={vocab_size} (ids must be below it); set vocab_size to at "
                              f"least {largest + 1} or rebuild the data with the model's tokenizer")
