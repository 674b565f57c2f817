"""The ``megatron.train`` and ``megatron.data`` sections of a job config (pure, no torch).

Read by ``ds-megatron train``; a bad value fails before anything heavy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from ..data.indexed_dataset import dataset_exists, max_token_id, token_dtype_code
from ..data.sft import is_packed_sft
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
    # Megatron's --lr-decay-iters: the step the decay reaches min_lr; None: train_iters.  Set it to extend a run
    # later (--resume --train-iters N) along the schedule it started on.
    lr_decay_iters: Optional[int] = None
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
    # A peer whose heartbeat (a thread of its own: a rank busy in a save or a collective still beats) stood still
    # this long is lost: every other rank names it and exits 4 at once, whatever it waits in (training/liveness.py).
    # 0: off (only the collective timeout then ends a job whose node is cut off or whose rank is stopped).
    heartbeat_timeout_seconds: float = 30.0

    def __post_init__(self):
        if not (isinstance(self.heartbeat_timeout_seconds, (int, float)) and not isinstance(
                self.heartbeat_timeout_seconds, bool) and (self.heartbeat_timeout_seconds == 0
                                                           or self.heartbeat_timeout_seconds >= 1)):
            raise ConfigError(f"{SECTION}.train.heartbeat_timeout_seconds must be 0 (off) or at least 1 (seconds), "
                              f"got {self.heartbeat_timeout_seconds!r}")
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
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ConfigError(f"{SECTION}.train.lr_decay_iters must be >= 1 or null (train_iters), "
                              f"got {self.lr_decay_iters}")
        if not self.lr > 0:
            raise ConfigError(f"{SECTION}.train.lr must be > 0, got {self.lr} (the schedule is relative to it)")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{SECTION}.train.min_lr={self.min_lr} must be in [0, lr={self.lr}]")

    def check_warmup(self, run: Optional[str] = None) -> Optional[str]:
        """The warmup against the schedule: one that outlasts ``lr_decay_iters`` is refused (the decay would end
        before it: Megatron asserts warmup < decay steps; our rate reaches ``lr`` on step ``lr_warmup_iters``, so
        they may be equal); one that outlasts the run (``train_iters``, ``run`` naming where that value came from)
        without ``lr_decay_iters`` is said in the returned line: the rate never reaches ``lr``, which a short trial
        run may mean.  Called once ``train_iters`` is final (``load_job``)."""
        warmup = f"{SECTION}.train.lr_warmup_iters={self.lr_warmup_iters}"
        if self.lr_decay_iters is not None:
            if self.lr_warmup_iters > self.lr_decay_iters:
                raise ConfigError(f"{warmup} exceeds {SECTION}.train.lr_decay_iters={self.lr_decay_iters}: the decay "
                                  f"would end before the warmup does; lower lr_warmup_iters to at most "
                                  f"{self.lr_decay_iters} or raise lr_decay_iters")
        elif self.lr_warmup_iters > self.train_iters:
            run = run or f"{SECTION}.train.train_iters={self.train_iters}"
            return (f"note: {warmup} is longer than the run ({run}), so the learning rate never reaches "
                    f"{SECTION}.train.lr; lower lr_warmup_iters to at most {self.train_iters}, train longer, or set "
                    f"{SECTION}.train.lr_decay_iters to the length of the whole schedule this run starts")
        return None


# A dataset: one prefix, or Megatron's blend list: ["0.3", "a", "0.7", "b"] (weight, prefix pairs) or ["a", "b"].
BlendValue = Optional[Union[str, List[Union[str, float]]]]
DATA_PATH_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
DEFAULT_SPLIT = "98,2"
_MAX_BLEND = 32767  # Megatron's limit (its dataset index is int16)


@dataclass
class Blend:
    """A parsed blend: its prefixes, their weights as written (None: weighted by their sizes), and the field that
    names each prefix (``megatron.data.data_path[1]``)."""

    prefixes: List[str]
    weights: Optional[List[float]]
    fields: List[str]


def _number(value) -> Optional[float]:
    """``value`` as a weight if it is a number or a string of one, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except ValueError:
        return None


def _check_prefix(field: str, prefix) -> str:
    if not isinstance(prefix, str):
        raise ConfigError(f"{field}={prefix!r} must be a dataset prefix (a string)")
    if not dataset_exists(prefix):
        corpus = ", or drop data_path to train on the built-in corpus" if field == f"{SECTION}.data.data_path" else ""
        raise ConfigError(f"{field}={prefix!r} has no {prefix}.bin / .idx; make them with `ds-megatron preprocess "
                          f"--input FILE --output-prefix PREFIX`{corpus}")
    try:
        token_dtype_code(prefix)
    except ValueError as e:
        raise ConfigError(f"{field}={prefix!r}: {e}") from None
    return prefix


def parse_blend(field: str, value: Union[str, List[Union[str, float]]]) -> Blend:
    """One prefix, or Megatron's blend list (weight, prefix pairs, or prefixes alone), checked element by element;
    a ConfigError names ``field[i]``."""
    if isinstance(value, str):
        return Blend([_check_prefix(field, value)], None, [field])
    if not value:
        raise ConfigError(f"{field} is an empty list; give a prefix, [\"0.3\", \"a\", \"0.7\", \"b\"] "
                          "(weight, prefix pairs) or [\"a\", \"b\"] (prefixes weighted by their sizes)")
    if len(value) > 2 * _MAX_BLEND:
        raise ConfigError(f"{field} blends more than {_MAX_BLEND} datasets (Megatron's limit); merge some")
    if _number(value[0]) is None:  # prefixes alone
        for i, prefix in enumerate(value):
            if _number(prefix) is not None:
                raise ConfigError(f"{field}[{i}]={prefix!r} is a number in a list of prefixes; a weighted blend "
                                  f"starts with a weight: [\"0.3\", \"a\", \"0.7\", \"b\"]")
            _check_prefix(f"{field}[{i}]", prefix)
        return Blend(list(value), None, [f"{field}[{i}]" for i in range(len(value))])
    if len(value) % 2:
        raise ConfigError(f"{field} has {len(value)} elements, an odd number, but starts with a weight; write "
                          f"weight, prefix pairs like [\"0.3\", \"a\", \"0.7\", \"b\"]")
    weights = []
    for i in range(0, len(value), 2):
        weight = _number(value[i])
        if weight is None:
            raise ConfigError(f"{field}[{i}]={value[i]!r} is not a number; a blend list is weight, prefix pairs "
                              f"like [\"0.3\", \"a\", \"0.7\", \"b\"]")
        if not 0 < weight < float("inf"):
            raise ConfigError(f"{field}[{i}]={value[i]!r}: a weight must be a finite number > 0")
        weights.append(weight)
        _check_prefix(f"{field}[{i + 1}]", value[i + 1])
    return Blend(list(value[1::2]), weights, [f"{field}[{i}]" for i in range(1, len(value), 2)])


@dataclass
class DataConfig:
    # Prefix of a .bin/.idx pair from `ds-megatron preprocess`, or Megatron's blend list of them; None: the embedded
    # stdlib corpus.  Or train_data_path / valid_data_path / test_data_path, each a prefix or a blend, without split.
    data_path: BlendValue = None
    split: Optional[str] = None  # None: DEFAULT_SPLIT with data_path (or the corpus); unused with train_data_path
    train_data_path: BlendValue = None
    valid_data_path: BlendValue = None
    test_data_path: BlendValue = None
    # Where a blend's indices are cached (Megatron's --data-cache-path); None: data_cache in train.output_dir.
    data_cache_path: Optional[str] = None
    # Megatron's pretraining flags (its _get_ltor_masks_and_position_ids); the two resets go together.
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
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
        split_paths = [k for k in DATA_PATH_KEYS[1:] if getattr(self, k) is not None]
        if self.data_path is not None and split_paths:
            raise ConfigError(f"{where}.data_path and {where}.{split_paths[0]} are both set; give data_path (cut by "
                              f"split) or train_data_path / valid_data_path / test_data_path, not both")
        if split_paths and self.train_data_path is None:
            raise ConfigError(f"{where}.{split_paths[0]} is set without {where}.train_data_path; add it, or give "
                              f"data_path with split instead")
        if split_paths and self.split is not None:
            raise ConfigError(f"{where}.split={self.split!r} is set with {where}.train_data_path, which is not cut "
                              "by split; remove split (valid_data_path / test_data_path give the other sets)")
        if not split_paths and self.split is None:
            self.split = DEFAULT_SPLIT
        for key in DATA_PATH_KEYS:
            self.blend(key)  # each prefix exists and holds integer tokens, each weight is a positive number
        if self.tokenizer_type is not None or self.tokenizer_model is not None:
            self._megatron_tokenizer_names()
        self.build_tokenizer()  # a missing or unreadable tokenizer fails here, naming the field
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"{where}.dataloader_type={self.dataloader_type!r} is unknown; use single or cyclic")
        train = self.blend("train_data_path" if self.train_data_path is not None else "data_path")
        if self.dataloader_type == "cyclic" and train is not None and len(train.prefixes) > 1:
            raise ConfigError(f"{where}.dataloader_type \"cyclic\" reshuffles one pass over a single dataset, but the "
                              "train set is a blend, which has no pass of its own; use \"single\" (each blended "
                              "dataset is read in a new order every epoch)")
        if self.num_workers < 0:
            raise ConfigError(f"{where}.num_workers must be >= 0, got {self.num_workers}")
        if self.reset_position_ids != self.reset_attention_mask:
            raise ConfigError(f"{where}.reset_position_ids={str(self.reset_position_ids).lower()} but "
                              f"reset_attention_mask={str(self.reset_attention_mask).lower()}: our models cut "
                              "attention exactly where the position ids restart, so set both true or both false")
        packed = [field for field, prefix in self.prefixes() if is_packed_sft(prefix)]
        if self.reset_position_ids and packed:
            raise ConfigError(f"{where}.reset_position_ids / reset_attention_mask are true but {packed[0]} is a packed "
                              "SFT dataset (ds-megatron preprocess --sft), whose rows carry their documents' "
                              "boundaries already; set both false")
        if self.reset_position_ids and not self.eod_mask_loss:
            raise ConfigError(f"{where}.reset_position_ids / reset_attention_mask are true but eod_mask_loss is "
                              "false: each EOD's label is then the next document's first token, which the EOD's "
                              "document cannot see (our models leave it untrained, Megatron trains it); set "
                              "eod_mask_loss true")

    @property
    def packed_sequences(self) -> bool:
        """Whether the job's rows pack several documents (Megatron's reset flags, or a packed SFT dataset), which
        every model path then keeps apart (``PackedSeqParams``)."""
        return self.reset_position_ids or any(is_packed_sft(prefix) for _, prefix in self.prefixes())

    def blend(self, key: str) -> Optional[Blend]:
        """The parsed value of ``key`` (``data_path``, ``train_data_path``, ...): None when it is not set."""
        value = getattr(self, key)
        return None if value is None else parse_blend(f"{SECTION}.data.{key}", value)

    def prefixes(self) -> List[Tuple[str, str]]:
        """``(field, prefix)`` of every dataset the config names."""
        blends = [self.blend(key) for key in DATA_PATH_KEYS if getattr(self, key) is not None]
        return [pair for blend in blends for pair in zip(blend.fields, blend.prefixes)]

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
        checked when it tokenizes the built-in corpus or is a Hugging Face one (a dataset made with it); each
        dataset's largest id comes from its ``.stats.json`` (written by ``preprocess``) or is read from the ``.bin``.
        """
        where = f"{SECTION}.data"
        prefixes = self.prefixes()
        if not prefixes or not is_byte(self.tokenizer):
            ids = self.build_tokenizer().vocab_size
            if ids > vocab_size:
                raise ConfigError(f"{where}.tokenizer={self.tokenizer!r} has {ids} token ids but "
                                  f"{SECTION}.model.vocab_size={vocab_size}; set vocab_size to at least {ids}")
        for field, prefix in prefixes:
            largest = max_token_id(prefix)
            if largest >= vocab_size:
                raise ConfigError(f"{field}={prefix!r} holds token id {largest} but {SECTION}.model.vocab_size="
                                  f"{vocab_size} (ids must be below it); set vocab_size to at least {largest + 1} "
                                  "or rebuild the data with the model's tokenizer")
