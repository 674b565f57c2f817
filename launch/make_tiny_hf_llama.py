"""Write a tiny random Llama in Hugging Face format, with its own BPE tokenizer, for trying the HF path offline.

    python launch/make_tiny_hf_llama.py runs/hf/tiny-llama [--seed 0]

The tokenizer is a byte-level BPE of 512 tokens trained with the ``tokenizers``
library on 1 MB of the embedded corpus (the running Python's standard library),
saved as a ``transformers`` tokenizer directory (``tokenizer.json``,
``tokenizer_config.json`` naming ``<|endoftext|>`` as eos); the model is
``LlamaForCausalLM`` built from a config (4 layers, hidden 64, 4 heads, 2 KV
heads, untied output), random weights in float32.  No download.
"""
import argparse
import os
import sys
import sysconfig

EOS = "<|endoftext|>"


def corpus_texts(max_bytes):
    from ds_megatron.data.corpus import stdlib_source_files
    root = sysconfig.get_paths()["stdlib"]
    for rel, _ in stdlib_source_files(max_bytes, root):
        with open(os.path.join(root, rel), "rb") as f:
            yield f.read().decode("utf-8", errors="replace")


def train_tokenizer(vocab_size=512, max_bytes=1_000_000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_texts(max_bytes), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def make_model(vocab_size, eos_token_id, seed=0, max_positions=256):
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config).float()


def write_tiny_model(make, doc, script, argv=None):
    """The command line of each ``make_tiny_hf_*.py``: ``OUT [--seed N]``, ``make(vocab_size, eos_token_id, seed)``
    with ``train_tokenizer``'s tokenizer saved to OUT (refused when OUT holds files); ``doc`` the script's
    docstring, ``script`` its file."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("out", help="directory to create")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"{os.path.basename(script)}: error: {args.out} exists and is not empty; choose a new directory")
    tokenizer = train_tokenizer()
    model = make(len(tokenizer), tokenizer.eos_token_id, args.seed)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {type(model).__name__}, {n:,} parameters, tokenizer of {len(tokenizer)} tokens "
          f"(eos {EOS!r} = id {tokenizer.eos_token_id})")
    return 0


def main(argv=None):
    return write_tiny_model(make_model, __doc__, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
