"""``ds-megatron export-fp32``: a checkpoint of any layout becomes the one full fp32 model.

Each case trains two steps on 4 gloo ranks, saves with ``ds_megatron.save_checkpoint`` and
exports with the CLI.  Two independent references:

* every rank's live weights (dense shards by tensor rank, experts by expert and expert-tensor
  rank) are bit-identical to their slice of the export: the files and the consolidation lose
  and misplace nothing;
* a TP=1 ``GPTModel`` of the same config loads the export (strict) and gives the trained
  model's logits (gathered from the tensor ranks) on a fresh batch.

The vocab (40, padded to 48 at TP=1, 64 at TP=2) makes the export trim TP=2's padding rows.
"""
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.cli import main as cli_main
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel.params import is_expert_param

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, seq_length=8, vocab_size=40,
            make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0)
CASES = {
    "tp2-dp2": (dict(tensor_model_parallel_size=2), {}),
    "tp2-ep2-moe": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
                    dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)),
    "tp2-pp2": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), {}),
    # Llama's shape without its gate: an untied output layer (its padding rows trimmed too), RMSNorm, RoPE, GQA.
    "tp2-untied-rope-gqa": (dict(tensor_model_parallel_size=2),
                            dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                                 untie_embeddings_and_output_weights=True, num_query_groups=2)),
}
# Tensors each rank compares with its slice of the export, at least.
MIN_CHECKED = {"tp2-dp2": 28, "tp2-ep2-moe": 28, "tp2-pp2": 12, "tp2-untied-rope-gqa": 15}


def _config(parallel):
    gas = parallel.get("pipeline_model_parallel_size", 1)  # a pipeline runs at least one micro-batch per stage
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
            "gradient_clipping": 1.0, "megatron": dict(parallel)}


def _batches(dp_rank, n):
    g = torch.Generator().manual_seed(7 + dp_rank)
    tokens = [torch.randint(0, BASE["vocab_size"], (2, BASE["seq_length"] + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _check_slices(engine, state, export):
    """Every local weight equals its slice of the export, bit for bit."""
    module = engine.module
    to_gpt = getattr(module, "gpt_name", lambda n: n)
    checked = 0
    for name, p in module.named_parameters():
        if is_expert_param(p):
            continue
        full = export[to_gpt(name)]
        local = p.detach().float()
        if getattr(p, "tensor_model_parallel", False):
            dim, size = p.partition_dim, p.shape[p.partition_dim]
            start = state.tp.rank * size
            length = min(size, full.shape[dim] - start)  # the export keeps TP=1's vocab rows only
            local = local.narrow(dim, 0, max(length, 0))
            full = full.narrow(dim, start, max(length, 0))
        assert torch.equal(local, full), name
        checked += 1
    for layer_name, layer in ((n, m) for n, m in module.named_modules() if hasattr(m, "experts")):
        experts = layer.experts
        for local_index, global_id in enumerate(experts.local_expert_indices):
            for key, w in experts.expert_weights(local_index).items():
                full = export[f"{to_gpt(layer_name)}.experts.local_experts.{global_id}.{key}"]
                dim = 0 if key == "linear_fc1.weight" else 1
                size = w.shape[dim]
                assert torch.equal(w.detach().float(), full.narrow(dim, state.etp.rank * size, size)), key
                checked += 1
    return checked


def _train_save_export(parallel, moe, tmp):
    cfg = _config(parallel)
    state = ds_megatron.initialize_model_parallel(cfg)
    gpt_config = GPTConfig(**BASE, **moe)
    torch.manual_seed(3)
    pipeline = parallel.get("pipeline_model_parallel_size", 1) > 1
    model = ds_megatron.GPTPipelineModule(gpt_config, state) if pipeline else GPTModel(gpt_config, state)
    engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        config=cfg, parallel_state=state)
    batches = _batches(state.dp.rank, 3)
    if pipeline:
        for _ in range(2):
            engine.train_batch(iter([(tokens, (labels, torch.ones(labels.shape))) for tokens, labels in batches[:2]]))
    for tokens, labels in batches[:2]:
        if not pipeline:
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
    ds_megatron.save_checkpoint(engine, tmp, tag="step2")
    files = sorted(os.listdir(os.path.join(tmp, "step2")))
    out = os.path.join(tmp, "model.safetensors" if moe else "model.pt")
    if dist.get_rank() == 0:
        assert cli_main(["export-fp32", tmp, out]) == 0
    dist.barrier()
    if out.endswith(".safetensors"):
        from safetensors.torch import load_file
        export = load_file(out)
    else:
        export = torch.load(out, weights_only=True)
    assert all(t.dtype == torch.float32 for t in export.values())
    checked = _check_slices(engine, state, export)

    reference = GPTModel(gpt_config, ParallelState.single())
    reference.load_state_dict(export, strict=True)  # every name and shape of a TP=1 model, nothing else
    max_diff = None
    if not pipeline:
        tokens = batches[2][0]
        engine.module.eval()
        with torch.no_grad():
            local = engine.module(tokens)  # [b, s, V_padded / tp]
            pieces = [torch.empty_like(local) for _ in range(state.tp.size)]
            dist.all_gather(pieces, local.contiguous(), group=state.tp.group)
            logits = torch.cat(pieces, dim=-1)[..., :BASE["vocab_size"]]
            expected = reference(tokens)[..., :BASE["vocab_size"]]
        max_diff = float((logits - expected).abs().max())
    engine.megatron.destroy()
    return files, checked, len(export), max_diff


@pytest.mark.parametrize("case", list(CASES))
def test_export_is_the_full_model(case, tmp_path):
    parallel, moe = CASES[case]
    results = run_on_ranks(4, _train_save_export, parallel, moe, str(tmp_path))
    files, checked, exported, max_diff = results[0]
    assert "zero_to_fp32.py" not in files  # DeepSpeed writes it next to ZeRO checkpoints only; ours are not
    # Every rank compared all its weights (a dense layer has 12 tensors, embeddings and final norm 4 more).
    assert all(r[1] >= MIN_CHECKED[case] for r in results), [r[1] for r in results]
    if max_diff is not None:
        assert max(r[3] for r in results) < 1e-5, [r[3] for r in results]


def test_export_refuses_a_checkpoint_without_the_record(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    torch.save({"module": {"w": torch.zeros(2)}}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    assert cli_main(["export-fp32", str(tmp_path / "t"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_00_model_states.pt has no ds_megatron_export record" in err
    assert not (tmp_path / "out.pt").exists()


def _gated_tp2_export(tmp):
    cfg = _config(dict(tensor_model_parallel_size=2))
    state = ds_megatron.initialize_model_parallel(cfg)
    model = GPTModel(GPTConfig(**BASE, gated_linear_unit=True, activation="silu"), state)
    engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        config=cfg, parallel_state=state)
    ds_megatron.save_checkpoint(engine, tmp, tag="step0")
    code = cli_main(["export-fp32", tmp, os.path.join(tmp, "model.pt")]) if dist.get_rank() == 0 else None
    dist.barrier()
    engine.megatron.destroy()
    return code


def test_export_refuses_shards_that_do_not_concatenate(tmp_path, capsys):
    # Each TP rank's gated fc1 is its own [gate; up]: concatenated they would not be the TP=1 tensor.
    assert run_on_ranks(2, _gated_tp2_export, str(tmp_path))[0] == 2
    assert not (tmp_path / "model.pt").exists()
