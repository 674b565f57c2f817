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
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
             activation="silu", untie_embeddings_and_output_weights=True, num_query_groups=2)
CASES = {
    "tp2-dp2": (dict(tensor_model_parallel_size=2), {}),
    "tp2-ep2-moe": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
                    dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)),
    "tp2-pp2": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), {}),
    # Llama's shape without its gate: an untied output layer (its padding rows trimmed too), RMSNorm, RoPE, GQA.
    "tp2-untied-rope-gqa": (dict(tensor_model_parallel_size=2),
                            dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                                 untie_embeddings_and_output_weights=True, num_query_groups=2)),
    # gpt-oss's experts: gated, biased, split over ETP 2 (= TP): each rank's fc1 its [gate; up], fc2's bias by columns
    "tp2-ep2-gpt-oss-moe": (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
                            dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, gated_linear_unit=True,
                                 activation="quick_gelu", moe_add_bias_linear=True)),
    # Llama's shape: each TP rank's fc1 is its own [gate; up] (no concatenation makes the TP=1 tensor).
    "tp2-llama": (dict(tensor_model_parallel_size=2), LLAMA),
    # Two KV groups on four TP ranks: each group's K/V projection copied on two ranks.
    "tp4-llama-kv-copies": (dict(tensor_model_parallel_size=4), LLAMA),
    # One KV group on both TP ranks of each stage, the stages' layers in DeepSpeed's per-layer files.
    "tp2-pp2-llama-one-kv-group": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                                   dict(LLAMA, num_query_groups=1)),
}
# Tensors each rank compares with its slice of the export, at least.
MIN_CHECKED = {"tp2-dp2": 28, "tp2-ep2-moe": 28, "tp2-ep2-gpt-oss-moe": 32,
               "tp2-pp2": 12, "tp2-untied-rope-gqa": 15, "tp2-llama": 15,
               "tp4-llama-kv-copies": 17, "tp2-pp2-llama-one-kv-group": 8}


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
    config, tp, t = module.config, state.tp.size, state.tp.rank
    for name, p in module.named_parameters():
        if is_expert_param(p):
            continue
        local = p.detach().float()
        if ".linear_q." in name or ".linear_kv." in name:
            # Megatron's fused QKV rows per query group: [its q heads, k, v]; rank t holds group t // (tp / g).
            d, g = config.head_dim, config.query_groups
            q_rows, replicas = config.num_attention_heads // g * d, tp // g
            group, copy = divmod(t, replicas)
            start = group * (q_rows + 2 * d) + (copy * local.shape[0] if ".linear_q." in name else q_rows)
            full = export[to_gpt(name).replace("linear_q", "query_key_value").replace("linear_kv", "query_key_value")]
            assert torch.equal(local, full[start:start + local.shape[0]]), name
            checked += 1
            continue
        full = export[to_gpt(name)]
        if "dense_h_to_4h" in name and config.gated_linear_unit:
            # Each rank's [gate; up] halves are its blocks of the whole gate and of the whole up projection.
            half, whole = local.shape[0] // 2, full.shape[0] // 2
            assert torch.equal(local[:half], full[t * half:(t + 1) * half]), name
            assert torch.equal(local[half:], full[whole + t * half:whole + (t + 1) * half]), name
            checked += 1
            continue
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
                dim = 1 if key == "linear_fc2.weight" else 0  # fc1 and the biases by rows, fc2 by columns
                local, r = w.detach().float(), state.etp.rank
                if key.startswith("linear_fc1") and config.gated_linear_unit:  # [gate; up] blocks of each half
                    half = local.shape[0] // 2
                    want = torch.cat([h.narrow(0, r * half, half) for h in full.chunk(2)])
                else:
                    want = full.narrow(dim, r * local.shape[dim], local.shape[dim])
                assert torch.equal(local, want) and (not key.endswith("bias") or local.abs().max() > 0), key
                checked += 1
    return checked


def _refused_as_version_1(saved, legacy):
    """The same gated experts at ETP 2, their records made version 1 (no model config): refused, not joined."""
    import shutil
    from ds_megatron.checkpointing.export_fp32 import ExportError, RECORD_KEY, consolidate
    shutil.copytree(saved, legacy)
    for name in os.listdir(legacy):
        if name.startswith("mp_rank_"):
            path = os.path.join(legacy, name)
            state = torch.load(path, weights_only=False)
            state[RECORD_KEY] = {k: v for k, v in state[RECORD_KEY].items() if k != "model"}
            state[RECORD_KEY]["version"] = 1
            torch.save(state, path)
    with pytest.raises(ExportError, match="does not say whether the experts' fc1 is gated"):
        consolidate(legacy)


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
        if moe.get("num_experts") and moe.get("gated_linear_unit"):
            _refused_as_version_1(os.path.join(tmp, "step2"), os.path.join(tmp, "legacy"))
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
    reference.double()  # the exported weights, widened exactly: the logits below carry the engine's rounding only
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
        max_diff = float((logits.double() - expected).abs().max())
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
        # The gathered float32 logits against the export's model in float64: the engine's float32 rounding alone
        # (2 layers, h=16: a few eps32 x |logit|; seen <= 7.4e-8 with torch's AVX2 and scalar kernels).
        assert max(r[3] for r in results) < 1e-5, [r[3] for r in results]


def test_export_refuses_a_checkpoint_without_the_record(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    torch.save({"module": {"w": torch.zeros(2)}}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    assert cli_main(["export-fp32", str(tmp_path / "t"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_00_model_states.pt has no ds_megatron_export record" in err
    assert not (tmp_path / "out.pt").exists()


def _damaged_exports(tmp):
    """A gated TP=2 checkpoint, then two damaged copies of it: one rank file missing, one rank's copy of a
    replicated weight changed.  Returns what consolidating each one raised."""
    import shutil
    from ds_megatron.checkpointing.export_fp32 import ExportError, RECORD_KEY, consolidate
    cfg = _config(dict(tensor_model_parallel_size=2))
    state = ds_megatron.initialize_model_parallel(cfg)
    model = GPTModel(GPTConfig(**BASE, **LLAMA), state)
    engine, *_ = ds_megatron.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        config=cfg, parallel_state=state)
    ds_megatron.save_checkpoint(engine, tmp, tag="step0")
    dist.barrier()
    engine.megatron.destroy()
    if dist.get_rank() != 0:
        return None
    errors = {}
    good = os.path.join(tmp, "step0")
    missing, changed = os.path.join(tmp, "missing"), os.path.join(tmp, "changed")
    shutil.copytree(good, missing)
    shutil.copytree(good, changed)
    os.remove(os.path.join(missing, "mp_rank_01_model_states.pt"))
    path = os.path.join(changed, "mp_rank_01_model_states.pt")
    saved = torch.load(path, weights_only=False)
    saved["module"]["final_layernorm.weight"] = saved["module"]["final_layernorm.weight"] + 1e-3
    torch.save(saved, path)
    legacy = os.path.join(tmp, "legacy")
    os.makedirs(legacy)
    saved[RECORD_KEY] = {**saved[RECORD_KEY], "version": 1, "unsupported": ["model.gated_linear_unit with "
                                                                            "tensor_model_parallel_size=2"]}
    torch.save(saved, os.path.join(legacy, "mp_rank_00_model_states.pt"))
    assert len(consolidate(good)) > 0
    for name in ("missing", "changed", "legacy"):
        try:
            consolidate(os.path.join(tmp, name))
        except ExportError as e:
            errors[name] = str(e)
    return errors


def test_export_refuses_missing_ranks_disagreeing_copies_and_old_records_it_cannot_join(tmp_path):
    errors = run_on_ranks(2, _damaged_exports, str(tmp_path))[0]
    assert "elements of" in errors["missing"] and "some tensor-parallel ranks' files are missing" in errors["missing"]
    assert "final_layernorm.weight differs from another rank's copy" in errors["changed"]
    assert "cannot join this layout's shards (model.gated_linear_unit" in errors["legacy"]
