"""``ds-megatron train`` on a packed chat dataset (``preprocess --sft``): the same losses at one rank, TP 2 + SP,
CP 2 and PP 2 (our runtime), and the loss falls.

Every layout trains the same global batch of 8 packed rows per step (micro-batch 4 x 2 accumulation steps, one data
parallel replica), so the only differences are float32 summation orders: the first step's loss (a forward from the
same weights) agrees to 1e-6 relative (a sum of n float32 terms in another order moves by about sqrt(n) x 2^-24
relative, a few 1e-7 at these widths), and the later steps' to 1e-5 (Adam's update divides each gradient by its own
running size, so a rounding-level difference in an element near zero becomes a difference of its step; over these 8
steps the layouts were measured within 8e-8 of one rank, and the loss falls by about 0.4).
"""
import os

import pytest
import torch.distributed as dist

import chat_data
from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.data.preprocess import preprocess_sft
from ds_megatron.training.train import train

STEPS, SEQ = 8, 64


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tokenizer = chat_data.write_tokenizer(str(root / "tokenizer"))
    rows = [{"prompt": s[:20], "completion": s[20:60]} for s in chat_data.sentences()[:400]]
    prefix = str(root / "chat")
    stats = preprocess_sft(chat_data.write_jsonl(str(root / "chat.jsonl"), rows), prefix, tokenizer, SEQ)
    assert stats.packed_rows < stats.documents  # several conversations share rows
    return prefix, tokenizer


def _config(out, prefix, tokenizer, layout):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 6,
        "megatron": {
            **layout,
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 64, "seq_length": SEQ, "vocab_size": 520, "position_embedding_type": "rope",
                      "normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
                      "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "train": {"train_iters": STEPS, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2, "eval_interval": 4,
                      "eval_iters": 1, "output_dir": out},
            "data": {"data_path": prefix, "tokenizer": tokenizer, "split": "90,10"},
        },
    }


def _train(cfg):
    job = load_job(cfg, dist.get_world_size())
    result = train(job, cfg, show_progress=False)
    return result.losses, result.val_losses


LAYOUTS = {"tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "cp2": {"context_parallel_size": 2},
           "pp2": {"pipeline_model_parallel_size": 2}}


def test_packed_chat_data_trains_the_same_at_every_layout(tmp_path, chat):
    prefix, tokenizer = chat
    (reference, reference_val), = run_on_ranks(1, _train, _config(str(tmp_path / "one"), prefix, tokenizer, {}))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert reference[STEPS] < reference[1] - 0.3, reference  # it learns the chats
    for name, layout in LAYOUTS.items():
        results = run_on_ranks(2, _train, _config(str(tmp_path / name), prefix, tokenizer, layout))
        losses, val = results[-1]  # the last rank: with PP the last stage
        assert abs(losses[1] - reference[1]) <= 1e-6 * reference[1], (name, losses[1], reference[1])
        for step in range(2, STEPS + 1):
            assert abs(losses[step] - reference[step]) <= 1e-5 * reference[step], (name, step, losses, reference)
        for step, value in val.items():
            assert abs(value - reference_val[step]) <= 1e-5 * reference_val[step], (name, step)
        print(f"{name}: largest relative loss difference from one rank "
              f"{max(abs(losses[s] - reference[s]) / reference[s] for s in losses):.1e}")
