"""Write a tiny random chat model (Hugging Face Llama with a chat template) and a chat dataset, offline.

    python launch/make_tiny_chat_model.py runs/hf/tiny-chat [--data runs/data/chat.jsonl]
        [--conversations 2000]

The model is ``launch/make_tiny_hf_llama.py``'s (4 layers, hidden 64, random float32 weights, a 512-token
byte-level BPE of the embedded corpus), 1024 positions, with two special tokens, ``<|im_start|>`` and ``<|im_end|>``, and a
ChatML-style chat template whose assistant answers sit inside ``{% generation %}`` markers, so
``ds-megatron preprocess --sft`` trains exactly the answers.  ``--data`` writes ``--conversations`` rows in the
``messages`` format, made from sentences of the running Python's standard-library docstrings (a system turn
sometimes, one to three question / answer turns, sometimes a tool turn), one JSON object a line.  No download.
"""
import argparse
import importlib
import inspect
import json
import os
import random
import re
import sys

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# An assistant turn adds its answer and end-of-turn (with the newline) after the generation prompt: the marked and
# the marker-less template (CHAT_TEMPLATE) train the same tokens.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="model directory to create")
    p.add_argument("--data", help="also write a chat dataset (.jsonl) here")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"make_tiny_chat_model.py: error: {args.out} exists and is not empty; choose a new directory")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_tiny_hf_llama import make_model, train_tokenizer
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_MARKERS
    tokenizer.pad_token = tokenizer.eos_token
    model = make_model(len(tokenizer), tokenizer.eos_token_id, args.seed, max_positions=1024)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: LlamaForCausalLM, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"tokenizer of {len(tokenizer)} tokens with a chat template")
    if args.data:
        write_jsonl(args.data, conversations(args.conversations, args.seed))
        print(f"wrote {args.data}: {args.conversations} conversations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
