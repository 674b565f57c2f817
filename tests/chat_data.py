"""A tiny chat tokenizer and chat datasets, made offline and deterministically, for SFT tests and examples.

``write_tokenizer(dir)`` writes a transformers tokenizer directory: the byte-level BPE of ``bpe_tokenizer.py``
plus the turn delimiters ``<|im_start|>`` / ``<|im_end|>`` as special tokens, and a ChatML-style chat template,
with ``{% generation %}`` markers around each assistant answer or (``generation_markers=False``) the same template
without them (both render the same text).  ``conversations(n)`` makes ``messages`` rows from sentences of the
running Python's standard-library docstrings; ``write_chat_jsonl(path, n)`` writes them one JSON object a line.
"""
import importlib
import inspect
import json
import os
import random
import re

from tokenizers import AddedToken, Tokenizer

from bpe_tokenizer import EOS, train_bpe

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The answer and its end-of-turn (with the newline after it) are what an assistant turn adds after the
# generation prompt, so the marked and the marker-less template train the same tokens.
CHAT_TEMPLATE_WITH_MARKERS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CHAT_TEMPLATE = CHAT_TEMPLATE_WITH_MARKERS.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Modules whose docstrings give the sentences (pure-Python ones, so their text is in the stdlib sources).
_DOC_MODULES = ("json", "textwrap", "string", "functools", "heapq", "bisect", "fractions", "shutil", "argparse",
                "csv", "difflib", "fnmatch", "glob", "gzip", "ipaddress", "pathlib", "pprint", "queue", "random",
                "shlex", "statistics", "tempfile", "uuid", "zipfile")


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


def sentences():
    """Sentences of standard-library docstrings, in a fixed order, without repeats."""
    seen, out = set(), []
    for name in _DOC_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attr)) if callable(getattr(module, attr)) else None
            if not doc:
                continue
            text = " ".join(doc.split("\n\n")[0].split())
            for s in re.split(r"(?<=[.!?])\s+", text):
                if 12 <= len(s) <= 200 and s not in seen:
                    seen.add(s)
                    out.append(s)
    return out


def conversations(n, seed=0):
    """``n`` ``messages`` rows: a user question and an answer, some with a system turn, more turns or a tool turn."""
    rng = random.Random(seed)
    pool = sentences()
    rows = []
    for i in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "Answer from the Python documentation."})
        for turn in range(rng.choice((1, 1, 1, 2, 3))):
            topic = rng.choice(pool)
            messages.append({"role": "user", "content": f"Question {i}.{turn}: explain this. {topic}"})
            if rng.random() < 0.15:
                messages.append({"role": "assistant", "content": f"Looking up: {topic[:20]}"})
                messages.append({"role": "tool", "content": rng.choice(pool)})
            answer = " ".join(rng.choice(pool) for _ in range(rng.choice((1, 1, 2, 4))))
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_chat_jsonl(path, n, seed=0):
    """``path``: ``n`` conversations (``conversations(n, seed)``), one JSON object a line."""
    return write_jsonl(path, conversations(n, seed))
