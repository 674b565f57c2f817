"""gpt-oss (transformers' ``GptOssForCausalLM``) through the converter, in float64 against transformers.

One tiny random model per module (``hf_models.make_gpt_oss``: every parameter re-drawn, sinks and all biases
included; windows of 4 in sequences of 12, layer 0 sliding and layer 1 full; gpt-oss's default yarn RoPE;
swiglu_limit 0.3, which the gate and up values cross).  Our logits equal transformers' float64 logits to 1e-10 at
one rank (``from_pretrained`` of its directory and of our converted one) and, in one 2-rank job, at TP=2 with SP,
PP=2, EP=2 and CP=2 in each exchange (the ring, all-gather, all-to-all), where the sinks' and the router bias's
gradients equal transformers' too; HF -> ours -> HF is bit-exact with config.json unchanged.  The sinks core
with packed rows (both forms) and with recomputation (a dense model) gives the plain run's logits and
gradients.  MXFP4 experts: hand-made blocks and scales dequantize as transformers'
``_convert_moe_packed_tensors`` does, and a directory holding them loads with transformers' logits of the
dequantized model, and exports in the model's dtype without the quantization_config.  The plan counts the model's
parameters.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_models
from harness import run_on_ranks
import ds_megatron
from ds_megatron.config.hf_config import hf_from_model, model_from_hf
from ds_megatron.config.model import GPTConfig
from ds_megatron.config.pipeline import stage_layer_counts, stage_layer_ranges
from ds_megatron.convert.checkpoint import HFSource, hf_to_ours, ours_to_hf
from ds_megatron.convert.fused_experts import dequantize_mxfp4
from ds_megatron.convert.model_io import load_weights
from ds_megatron.errors import ConvertError
from ds_megatron.models import GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

VOCAB, SEQ = hf_models.VOCAB, hf_models.SEQ


def _config_json_of(**overrides):
    import transformers as T
    return hf_models.hf_config_json(T.GptOssConfig, hf_models.GPT_OSS, "GptOssForCausalLM", **overrides)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(the transformers model, its directory, tokens, float64 logits, a directory)."""
    return hf_models.saved_family(hf_models.make_gpt_oss, tmp_path_factory.mktemp("gpt_oss"))


def test_config_maps_every_field():
    family, model = model_from_hf(_config_json_of())
    assert family == "gpt_oss"
    assert {k: model[k] for k in (
        "kv_channels", "num_query_groups", "add_qkv_bias", "add_bias_linear", "softmax_type", "activation",
        "activation_func_clamp_value", "glu_linear_offset", "moe_add_bias_linear", "moe_router_pre_softmax",
        "window_size", "window_attn_skip_freq", "rope_scaling_type", "rope_scaling_factor", "rotary_base",
        "original_max_position_embeddings", "yarn_correction_range_round_to_int", "norm_epsilon")} == dict(
        kv_channels=16, num_query_groups=2, add_qkv_bias=True, add_bias_linear=True, softmax_type="learnable",
        activation="quick_gelu", activation_func_clamp_value=0.3, glu_linear_offset=1.0, moe_add_bias_linear=True,
        moe_router_pre_softmax=False, window_size=[3, 0], window_attn_skip_freq=[1, 0], rope_scaling_type="yarn",
        rope_scaling_factor=32.0, rotary_base=150000.0, original_max_position_embeddings=4096,
        yarn_correction_range_round_to_int=False, norm_epsilon=1e-5)
    GPTConfig(**model)
    base = {**_config_json_of(), "quantization_config": {"quant_method": "mxfp4"}}
    assert model_from_hf(base)[1] == model
    assert hf_from_model(family, model, base) == _config_json_of()  # exported dequantized: no quantization_config


@pytest.mark.parametrize("overrides,match", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported; ds_megatron builds gpt-oss's gate activation"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config={'quant_method': 'fp8'} is not "
                                                        "supported; only gpt_oss's MXFP4 experts"),
    (dict(layer_types=["sliding_attention"]), "layer_types=['sliding_attention'] is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type='dynamic'"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_unsupported_fields_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConvertError) as e:
        model_from_hf({**_config_json_of(), **overrides})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config.json: ") and match in msg, msg


def test_one_rank_equals_transformers_and_round_trips(gpt_oss):
    hf_model, hf_dir, toks, ref, tmp = gpt_oss
    ours = hf_to_ours(hf_dir, str(tmp / "ours_tp1"))
    for path, grouped in ((hf_dir, True), (ours, False)):  # both experts classes (their biases)
        model = ds_megatron.from_pretrained(path, dtype=torch.float64, seq_length=SEQ,
                                            moe_grouped_gemm=grouped).eval()
        with torch.no_grad():
            assert hf_models.max_relative_error(model(toks)[..., :VOCAB], ref) < 1e-10, path
    # the plan counts what the model holds (sinks, router and expert biases)
    from ds_megatron.planning import gpt_param_counts
    assert gpt_param_counts(model.config, 1).total == sum(p.numel() for p in model.parameters())
    with torch.no_grad():  # the sinks are in play
        for layer in model.layers:
            layer.self_attention.sinks.zero_()
        assert hf_models.max_relative_error(model(toks)[..., :VOCAB], ref) > 1e-3
    hf_models.assert_round_trip(hf_dir, ours, str(tmp / "back_tp1"))


def test_the_attention_sinks_gradient_equals_transformers(gpt_oss):
    hf_model, hf_dir, toks, _, _ = gpt_oss
    ref = hf_models.float64_reference(hf_model)
    ref.zero_grad()
    ref(toks).logits.square().sum().backward()
    model = ds_megatron.from_pretrained(hf_dir, dtype=torch.float64, seq_length=SEQ).eval()
    model(toks)[..., :VOCAB].square().sum().backward()
    for i, layer in enumerate(model.layers):
        want = ref.model.layers[i].self_attn.sinks.grad
        got = layer.self_attention.sinks.grad
        assert float((got - want).abs().max() / want.abs().max()) < 1e-10, i
        bias = ref.model.layers[i].mlp.router.bias.grad
        assert float((layer.mlp.router.bias.grad - bias).abs().max() / bias.abs().max()) < 1e-10, i


def _sink_grads(model, rows, weights):
    """``model`` (float64, training mode) on ``rows`` (a list of (tokens ``[b, s]``, the forward's document keyword
    arguments)), the sum over rows of ``(logits * weights).sum()`` backpropagated: its logits of each row and every
    parameter's gradient by name (None: it got none)."""
    logits = []
    for (toks, documents), w in zip(rows, weights):
        out = model(toks, **documents)[..., :VOCAB]
        (out * w).sum().backward()
        logits.append(out.detach())
    return logits, {n: p.grad for n, p in model.named_parameters()}


def _packed_rows(seed=7):
    """Two packed rows of documents (5 + 7 and 2 + 9 + 1 tokens, longer than the windows of 4), a weight per logit:
    ((the rows with their position_ids, the weights), (each document alone, its share of the weights),
    (the rows as cu_seqlens, one row per micro-batch, and the weights))."""
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, VOCAB, (n,), generator=g) for n in row] for row in ([5, 7], [2, 9, 1])]
    tokens = torch.stack([torch.cat(row) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    weights = torch.randn(2, SEQ, VOCAB, generator=g, dtype=torch.float64)
    alone, alone_w = [], []
    for r, row in enumerate(docs):
        at = 0
        for d in row:
            alone.append((d[None], {}))
            alone_w.append(weights[r, at:at + len(d)])
            at += len(d)
    bounds = [(tokens[r:r + 1], {"cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32)})
              for r, lengths in enumerate(([5, 7], [2, 9, 1]))]
    return ([(tokens, {"position_ids": positions})], [weights]), (alone, alone_w), (bounds, [weights[:1], weights[1:]])


def _assert_same(got, want, what):
    (logits, grads), (logits_want, grads_want) = got, want
    flat = [torch.cat([x.reshape(-1, VOCAB) for x in each]) for each in (logits, logits_want)]
    assert hf_models.max_relative_error(*flat) < 1e-12, what
    assert sorted(grads) == sorted(grads_want) and any(n.endswith("sinks") for n in grads_want)
    for name, grad in grads_want.items():
        assert grads[name] is not None and float((grads[name] - grad).abs().max() / grad.abs().max()) < 1e-12, \
            (name, what)


def test_sinks_with_packed_documents_equal_each_document_alone(gpt_oss):
    """gpt-oss's packed rows, in both forms: the logits and every gradient (the sinks' too) of each document run
    alone."""
    packed, alone, bounds = _packed_rows()

    def run(rows):
        return _sink_grads(ds_megatron.from_pretrained(gpt_oss[1], dtype=torch.float64, seq_length=SEQ).train(), *rows)
    want = run(alone)
    _assert_same(run(packed), want, "position_ids")
    _assert_same(run(bounds), want, "cu_seqlens")


def test_sinks_with_recomputation_equal_the_plain_run():
    """A model with recomputation refuses experts (config/model.py), so gpt-oss's attention (sinks, windows of 4,
    2 query groups, biases) in a dense model: selective core_attn and full recomputation, whole and packed rows,
    give the logits and gradients of the run without it."""
    config = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                  ffn_hidden_size=16, seq_length=SEQ, vocab_size=VOCAB, position_embedding_type="rope",
                  normalization="RMSNorm", add_qkv_bias=True, softmax_type="learnable", window_size=[3, 0],
                  window_attn_skip_freq=[1, 0])
    packed, alone, _ = _packed_rows()

    def run(rows, **recompute):
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**config, **recompute), ParallelState.single()).double().train()
        with torch.no_grad():
            for layer in model.layers:  # sinks of the scores' size (they start at 0)
                layer.self_attention.sinks.normal_()
        return _sink_grads(model, *rows)
    for rows in (packed, alone):
        want = run(rows)
        for recompute in (dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                          dict(recompute_granularity="full")):
            _assert_same(run(rows, **recompute), want, recompute)


# tp, pp, ep, etp, sequence parallel, context parallel (its exchange), read from
LAYOUTS = [(2, 1, 1, 1, True, None, "hf"), (1, 2, 1, 1, False, None, "ours"), (1, 1, 2, 1, False, None, "ours"),
           (1, 1, 2, 1, False, None, "hf"), (1, 1, 1, 1, False, "p2p", "hf"), (1, 1, 1, 1, False, "all_gather", "hf"),
           (1, 1, 1, 1, False, "a2a", "hf"), (1, 1, 1, 2, False, None, "ours")]  # ETP 2: expert biases split



def _logits_of_layouts(cases, hf_dir, toks):
    """Our logits at each (layout, path) of ``cases`` in this job: on the last stage's ranks, None on the others;
    under CP with the sinks' and router biases' gradients of the logits' sum of squares, summed over CP."""
    out = []
    for (tp, pp, ep, etp, sp, cp, _), path in cases:
        state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, etp=etp,
                                                   cp=2 if cp else 1))
        config = HFSource(hf_dir).gpt_config(sequence_parallel=sp, seq_length=SEQ, cp_comm_type=cp or "p2p")
        stages = [list(r) for r in stage_layer_ranges(stage_layer_counts(config.num_layers, pp, "uniform", None,
                                                                         None))]
        try:
            if cp:
                model = GPTModel(config, state).double().eval()
                load_weights(model, path, state, stages)
                logits = model(toks)
                logits[..., :VOCAB].square().sum().backward()
                grads = [p.grad for layer in model.layers
                         for p in (layer.self_attention.sinks, layer.mlp.router.bias)]
                for g in grads:
                    dist.all_reduce(g, group=state.cp.group)
                out.append((hf_models.gather_logits(logits.detach(), state), grads))
                continue
            out.append(hf_models.layout_logits(config, state, path, stages, toks))
        finally:
            state.destroy()
    return out


def test_every_layout_equals_transformers_and_round_trips(gpt_oss):
    hf_model, hf_dir, toks, ref, tmp = gpt_oss
    reference = hf_models.float64_reference(hf_model)
    reference.zero_grad()
    reference(toks).logits.square().sum().backward()
    want = [p.grad for layer in reference.model.layers for p in (layer.self_attn.sinks, layer.mlp.router.bias)]
    cases = []
    for i, lay in enumerate(LAYOUTS):
        tp, pp, ep, etp, _, _, via = lay
        ours = str(tmp / f"ours_{i}")
        cases.append((lay, hf_to_ours(hf_dir, ours, tp=tp, pp=pp, ep=ep, etp=etp) if via == "ours" else hf_dir))
    per_rank = run_on_ranks(2, _logits_of_layouts, cases, hf_dir, toks)
    for i, (lay, path) in enumerate(cases):
        results = [r[i] for r in per_rank if r[i] is not None]
        assert results
        for got in results:
            if isinstance(got, tuple):  # CP: the gradients too
                got, grads = got
                for g, w in zip(grads, want):
                    assert hf_models.max_relative_error(g, w) < 1e-10, lay
            err = hf_models.max_relative_error(got, ref)
            assert err < 1e-10, (lay, err)
        if path != hf_dir:
            hf_models.assert_round_trip(hf_dir, path, str(tmp / f"back_{i}"))


# -- MXFP4 experts ---------------------------------------------------------------------------------------------------

def _mxfp4(shape, generator):
    """Random MXFP4 ``blocks [*shape, 16]`` (every code) and ``scales shape`` (exponents 2^-3 .. 2^1)."""
    blocks = torch.randint(0, 256, tuple(shape) + (16,), generator=generator, dtype=torch.uint8)
    scales = torch.randint(124, 129, tuple(shape), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks, scales = _mxfp4((3, 8, 2), g)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 255  # the extreme exponents too
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        want = _convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, 64, 8]: transposed
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want), dtype


def test_an_mxfp4_directory_loads_as_transformers_dequantizes_it(tmp_path):
    """The released checkpoints' layout: experts' weights in blocks and scales (their inputs, multiples of 32),
    biases in the model's dtype; our logits equal transformers' model holding ``_convert_moe_packed_tensors``'
    weights, and the export is that model."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    hf_model, toks = hf_models.make_gpt_oss(intermediate_size=32), hf_models.tokens()
    hf_dir = hf_models.save(hf_model, str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(7)
    sd = hf_models.directory_tensors(hf_dir)
    for i in range(hf_model.config.num_hidden_layers):
        experts = hf_model.model.layers[i].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            weight = sd.pop(name)  # [E, in, out]
            blocks, scales = _mxfp4((weight.size(0), weight.size(2), weight.size(1) // 32), g)
            sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, proj).copy_(_convert_moe_packed_tensors(blocks, scales, dtype=torch.float64))
    quant = tmp_path / "mxfp4"
    quant.mkdir()
    save_file(sd, str(quant / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**hf_models.config_json(hf_dir), "quantization_config": {"quant_method": "mxfp4",
                                                            "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    (quant / "config.json").write_text(json.dumps(cfg))
    ref = hf_models.reference_logits(hf_model, toks)
    model = ds_megatron.from_pretrained(str(quant), dtype=torch.float64, seq_length=SEQ).eval()
    with torch.no_grad():
        assert hf_models.max_relative_error(model(toks)[..., :VOCAB], ref) < 1e-10
    back = ours_to_hf(hf_to_ours(str(quant), str(tmp_path / "ours"), ep=2), str(tmp_path / "back"))
    exported = hf_models.directory_tensors(back)
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    for name, tensor in hf_model.state_dict().items():
        assert exported[name].dtype == torch.float64 and torch.equal(exported[name], tensor), name
    assert "quantization_config" not in hf_models.config_json(back)
    with pytest.raises(ConvertError, match=r"mlp\.experts\.down_proj needs exactly .*_blocks and .*_scales"):
        del sd["model.layers.1.mlp.experts.down_proj_scales"]
        save_file(sd, str(quant / "model.safetensors"), metadata={"format": "pt"})
        HFSource(str(quant))


# -- training ------------------------------------------------------------------------------------------------------

def _train(cfg):
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    return train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False).losses


def test_train_load_hf_one_step_exports_what_transformers_loads(tmp_path):
    """``ds-megatron train --load-hf`` at TP=2 + SP x PP=2 (our pipeline runtime) x EP=2 (ETP 1) for one step: every
    tensor moves (sinks and biases too), and the export (config.json as it came) loads in transformers and
    generates."""
    import transformers
    from ds_megatron.cli import main as cli_main
    hf_dir = hf_models.save(hf_models.make_gpt_oss(dtype=torch.float32, vocab_size=300), str(tmp_path / "hf"))
    out = str(tmp_path / "run")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True,
                        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
                        "model": {"seq_length": 16},
                        "train": {"train_iters": 1, "lr": 1e-2, "min_lr": 0.0, "lr_warmup_iters": 0,
                                  "eval_interval": 100, "eval_iters": 1, "output_dir": out, "load_hf": hf_dir},
                        "data": {"default_corpus_bytes": 200_000, "split": "80,20"}}}
    assert sorted(run_on_ranks(4, _train, cfg)[0]) == [1]
    exported = str(tmp_path / "exported")
    assert cli_main(["convert", os.path.join(out, "iter_0000001", "ds_megatron_model"), exported]) == 0
    before, after = hf_models.directory_tensors(hf_dir), hf_models.directory_tensors(exported)
    assert sorted(before) == sorted(after)
    assert [n for n in before if torch.equal(before[n], after[n])] == []
    assert hf_models.config_json(exported) == hf_models.config_json(hf_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert all(torch.equal(p.detach(), after[n]) for n, p in reloaded.named_parameters())
    assert reloaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
