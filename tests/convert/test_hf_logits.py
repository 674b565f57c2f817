"""Models imported from Hugging Face give transformers' logits (float64, 1e-10) at TP=1/2/4, SP, PP=2 and EP=2.

Every family at every layout with plain RoPE (Gemma 2 / 3 at four of them); RoPE scaling (llama3, yarn, linear) at
a few layouts each.

Each rank builds our model from the converted config and loads its own shards,
either straight from the Hugging Face directory (converted on the fly, as
``load_hf`` does in a job) or from a directory ``ds-megatron convert`` wrote at
that layout; the last stage gathers the vocab-parallel logits.  The reference is
the transformers model itself (``hf_models.float64_reference``).
"""
import pytest
import torch
import torch.distributed as dist

import hf_models
from harness import run_on_ranks
from ds_megatron.config.pipeline import stage_layer_counts, stage_layer_ranges
from ds_megatron.convert.checkpoint import HFSource, hf_to_ours
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState

WORLD = 4


def _logits_at(state, path, hf_dir, sp, toks):
    """Our model of ``hf_dir``'s config at ``state``'s layout, its weights read from ``path``: the logits on the last
    stage's ranks (gathered over TP), None on the others."""
    config = HFSource(hf_dir).gpt_config(sequence_parallel=sp, seq_length=hf_models.SEQ)
    stages = [list(r) for r in stage_layer_ranges(stage_layer_counts(config.num_layers, state.pp.size, "uniform",
                                                                     None, None))]
    return hf_models.layout_logits(config, state, path, stages, toks)


def _our_logits(path, hf_dir, tp, pp, ep, sp, toks):
    return _our_logits_each([(path, hf_dir)], tp, pp, ep, sp, toks)[0]


def _our_logits_each(models, tp, pp, ep, sp, toks):
    """``_logits_at`` of each (path, Hugging Face directory) in ``models``, at one layout built once."""
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep))
    try:
        return [_logits_at(state, path, hf_dir, sp, toks) for path, hf_dir in models]
    finally:
        state.destroy()


LAYOUTS = [  # tp, pp, ep, sequence parallel, load from
    (1, 1, 1, False, "hf"), (2, 1, 1, False, "ours"), (2, 1, 1, True, "hf"), (4, 1, 1, False, "hf"),
    (4, 1, 1, True, "ours"), (2, 2, 1, False, "hf"), (1, 2, 1, False, "ours"),
]
MOE_LAYOUTS = [(1, 1, 2, False, "hf"), (2, 1, 2, True, "ours"), (1, 2, 2, False, "hf")]
# Gemma (sliding windows by layer, soft-capping, four norms a layer): one rank, TP 2 with SP, TP 2 x PP 2, PP 2
GEMMA_LAYOUTS = [(1, 1, 1, False, "hf"), (2, 1, 1, True, "hf"), (2, 2, 1, False, "hf"), (1, 2, 1, False, "ours")]
CASES = [(f, *lay) for f in hf_models.FAMILIES
         for lay in (GEMMA_LAYOUTS if f in hf_models.GEMMA else LAYOUTS + (MOE_LAYOUTS if f in hf_models.MOE else []))]


# family, hf_models.ROPE_SCALINGS key, layout: each type at a few layouts, not the cross product
ROPE_CASES = [
    ("llama", "llama3", (2, 1, 1, True, "hf")), ("llama", "llama3", (1, 2, 1, False, "ours")),
    ("llama", "yarn", (4, 1, 1, False, "hf")), ("llama", "linear", (2, 2, 1, False, "hf")),
    ("qwen3", "yarn", (2, 1, 1, True, "ours")), ("qwen3", "yarn_mscale", (4, 1, 1, True, "hf")),
    ("qwen3", "llama3", (1, 1, 1, False, "hf")), ("qwen2", "yarn", (2, 2, 1, False, "ours")),
    ("qwen3_moe", "yarn", (1, 1, 2, False, "hf")),
]
# (family, rope, (tp, pp, ep, sp, via)) of both tests below
ALL_CASES = [(f, None, tuple(lay)) for f, *lay in CASES] + ROPE_CASES


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    """``logits(family, rope, layout)``: (the logits our ranks returned, transformers' float64 logits).  Each tiny
    model is made once; the cases of one layout (tp, pp, ep, sp) run in one 4-rank job on one ParallelState, the
    first time one of them is asked for (a job per case spent most of its time starting and collecting garbage)."""
    tmp, toks = tmp_path_factory.mktemp("hf_logits"), hf_models.tokens()
    made, done = {}, {}

    def model(family, rope):
        if (family, rope) not in made:
            hf = hf_models.make_model(family, rope=rope)
            made[(family, rope)] = (hf_models.save(hf, str(tmp / f"{family}-{rope}" / "hf")),
                                    hf_models.reference_logits(hf, toks))
        return made[(family, rope)]

    def get(family, rope, layout):
        tp, pp, ep, sp, _ = layout
        if layout[:4] not in done:
            cases = [(f, r, lay) for f, r, lay in ALL_CASES if lay[:4] == layout[:4]]
            models = []
            for f, r, (*_, via) in cases:
                hf_dir = model(f, r)[0]
                ours = str(tmp / f"{f}-{r}" / f"ours-tp{tp}-pp{pp}-ep{ep}")
                models.append((hf_dir if via == "hf" else hf_to_ours(hf_dir, ours, tp=tp, pp=pp, ep=ep), hf_dir))
            per_rank = run_on_ranks(WORLD, _our_logits_each, models, tp, pp, ep, sp, toks)
            done[layout[:4]] = {case: [r[i] for r in per_rank if r[i] is not None] for i, case in enumerate(cases)}
        return done[layout[:4]][(family, rope, layout)], model(family, rope)[1]
    return get


@pytest.mark.parametrize("family,tp,pp,ep,sp,via", CASES,
                         ids=[f"{f}-tp{t}-pp{p}-ep{e}{'-sp' if s else ''}-{v}" for f, t, p, e, s, v in CASES])
def test_logits_equal_transformers(logits, family, tp, pp, ep, sp, via):
    results, ref = logits(family, None, (tp, pp, ep, sp, via))
    assert results
    for got in results:
        err = hf_models.max_relative_error(got, ref)
        print(f"max relative logits error {family} tp={tp} pp={pp} ep={ep} sp={sp} via {via}: {err:.1e}")
        assert err < 1e-10, (family, tp, pp, ep, sp, err)


@pytest.mark.parametrize("family,rope,layout", ROPE_CASES,
                         ids=[f"{f}-{r}-tp{t}-pp{p}-ep{e}{'-sp' if s else ''}-{v}" for f, r, (t, p, e, s, v) in ROPE_CASES])
def test_scaled_rope_logits_equal_transformers(logits, family, rope, layout):
    results, ref = logits(family, rope, layout)
    assert results
    for got in results:
        assert hf_models.max_relative_error(got, ref) < 1e-10, (family, rope, layout)


def test_tied_embeddings_through_the_pipeline(tmp_path):
    """Qwen2 with tie_word_embeddings: one HF tensor feeds our tied pair (first stage, last stage)."""
    model = hf_models.make_model("qwen2", tie_word_embeddings=True)
    hf_dir = hf_models.save(model, str(tmp_path / "hf"))
    toks = hf_models.tokens()
    ref = hf_models.reference_logits(model, toks)
    for tp, pp in ((2, 1), (2, 2)):
        results = [r for r in run_on_ranks(WORLD, _our_logits, hf_dir, hf_dir, tp, pp, 1, False, toks) if r is not None]
        assert all(hf_models.max_relative_error(r, ref) < 1e-10 for r in results)


# Dense layers (intermediate_size) between the MoE layers, as transformers builds them: Qwen2-MoE every second layer
# sparse (decoder_sparse_step 2: layers 1, 3), Qwen3-MoE with its first two layers dense (mlp_only_layers), so that
# pipeline stage 0 holds no expert.  Imported (moe_layer_freq [0, 1, 0, 1] / [0, 0, 1, 1]), run, exported back.
SPARSE_CASES = [("qwen2_moe", dict(decoder_sparse_step=2), [0, 1, 0, 1], (2, 1, 2, True, "ours")),
                ("qwen3_moe", dict(mlp_only_layers=[0, 1]), [0, 0, 1, 1], (1, 2, 2, False, "ours"))]


@pytest.mark.parametrize("family,sparsity,pattern,layout", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_dense_layers_between_moe_layers_equal_transformers(tmp_path, family, sparsity, pattern, layout):
    import json
    import os
    from ds_megatron.convert.checkpoint import HFSource, METADATA, ours_to_hf
    from safetensors.torch import load_file

    def _tensors(d):
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}
    tp, pp, ep, sp, via = layout
    model = hf_models.make_model(family, num_hidden_layers=4, **sparsity)
    assert [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers] == \
        [bool(p) for p in pattern]
    hf_dir = hf_models.save(model, str(tmp_path / "hf"))
    assert HFSource(hf_dir).gpt_config().moe_layer_freq == pattern
    toks = hf_models.tokens()
    ref = hf_models.reference_logits(model, toks)
    ours = hf_to_ours(hf_dir, str(tmp_path / "ours"), tp=tp, pp=pp, ep=ep)
    assert json.load(open(tmp_path / "ours" / METADATA))["model"]["moe_layer_freq"] == pattern
    for path in (ours, hf_dir):  # a directory of ours, and the Hugging Face one read directly (--load-hf)
        results = [r for r in run_on_ranks(WORLD, _our_logits, path, hf_dir, tp, pp, ep, sp, toks) if r is not None]
        assert results and all(hf_models.max_relative_error(r, ref) < 1e-10 for r in results), family
    back = ours_to_hf(ours, str(tmp_path / "back"))
    before, after = _tensors(hf_dir), _tensors(back)
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    assert json.load(open(tmp_path / "hf" / "config.json")) == json.load(open(tmp_path / "back" / "config.json"))
