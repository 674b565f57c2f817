"""A small byte-level BPE trained with the ``tokenizers`` library on a slice of the embedded corpus (no download)."""
import json
import os
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds_megatron.data.corpus import stdlib_source_files

EOS = "<|endoftext|>"


def corpus_texts(max_bytes=300_000):
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for rel, _ in stdlib_source_files(max_bytes, root):
        with open(os.path.join(root, rel), "rb") as f:
            out.append(f.read().decode("utf-8", errors="replace"))
    return out


def train_bpe(directory, vocab_size=512, max_bytes=300_000, with_config=True):
    """``directory/tokenizer.json`` (and a transformers ``tokenizer_config.json`` naming the eos token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(max_bytes), trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if with_config:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}, f)
    return directory
