"""A tiny chat tokenizer and chat datasets, made offline and deterministically, for SFT tests and examples.

The chat template and the conversations are ``launch/make_tiny_chat_model.py``'s.  ``write_tokenizer(dir)``
writes a transformers tokenizer directory: the byte-level BPE of ``bpe_tokenizer.py``
plus the turn delimiters ``<|im_start|>`` / ``<|im_end|>`` as special tokens, and a ChatML-style chat template,
with ``{% generation %}`` markers around each assistant answer or (``generation_markers=False``) the same template
without them (both render the same text).  ``conversations(n)`` makes ``messages`` rows from sentences of the
running Python's standard-library docstrings; ``write_chat_jsonl(path, n)`` writes them one JSON object a line.
"""
import importlib.util
import json
import os

from tokenizers import AddedToken, Tokenizer

from bpe_tokenizer import EOS, train_bpe


def _maker():
    """``launch/make_tiny_chat_model.py``, the one home of the chat template and the conversations."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                        "make_tiny_chat_model.py")
    spec = importlib.util.spec_from_file_location("make_tiny_chat_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_MAKER = _maker()
IM_START, IM_END = _MAKER.IM_START, _MAKER.IM_END
CHAT_TEMPLATE_WITH_MARKERS, CHAT_TEMPLATE = _MAKER.CHAT_TEMPLATE_WITH_MARKERS, _MAKER.CHAT_TEMPLATE
sentences, conversations, write_jsonl = _MAKER.sentences, _MAKER.conversations, _MAKER.write_jsonl


def write_tokenizer(directory, generation_markers=True, chat_template=None, vocab_size=512):
    """A transformers tokenizer directory with a chat template (``chat_template`` replaces the built-in ones)."""
    train_bpe(directory, vocab_size=vocab_size, with_config=False)
    path = os.path.join(directory, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens([AddedToken(IM_START, special=True), AddedToken(IM_END, special=True)])
    tok.save(path)
    if chat_template is None:
        chat_template = CHAT_TEMPLATE_WITH_MARKERS if generation_markers else CHAT_TEMPLATE
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
                   "chat_template": chat_template}, f)
    return directory


def write_chat_jsonl(path, n, seed=0):
    """``path``: ``n`` conversations (``conversations(n, seed)``), one JSON object a line."""
    return write_jsonl(path, conversations(n, seed))
