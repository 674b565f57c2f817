"""FP8 with pipeline parallelism: our runtime's schedules (interleaved 1F1B, ZB-H1 with its deferred weight
gradients) train as the same model on one rank, to float32 rounding.

Why: a pipeline moves whole activations and gradients between stages (bit-exact sends) and each stage
runs every micro-batch through its layers as one rank would, so each fp8 linear quantizes the same tensors with
the same scales (tensorwise: the tensor's own amax; delayed: the step's scale, and the history gets MAX over the
same micro-batches, which no order changes), multiplies them in the same GEMMs and accumulates the micro-batches'
weight gradients into the fp32 buffers in the same order (micro-batch 0 first on every chunk).  The one-rank run
takes the same 8 micro-batches on one rank (data parallelism would sum the gradients in another grouping).  The
deferred W of ZB-H1 must run on the fp8 copies of X and dY its B pass made to be the same numbers; so must the fp8
MoE experts' (every layer MoE, 4 experts on each stage, their grouped weight-gradient GEMMs deferred too).  What differs
is outside the fp8 layers: the tied word embedding's two copies have their gradients summed over the pipeline's
``embedding`` group instead of in one autograd accumulation, a float32 rounding (seen: 6.5e-8 in the weights
after 3 steps, every fp8 linear within 1.2e-8); the tolerance is the fp32 one of ``test_pipeline_equivalence``
(1e-5, Adam's eps 1e-4 keeping such noise from growing).  A W pass on the unquantized tensors is 1e-2 off.

The model trains in float32 with fp8 GEMMs (the config refuses fp8 without bf16 for training jobs; the model
itself takes any dtype): bf16 parameters would make the runs differ by the rounding of the two runs' different
loss and gradient plumbing (``test_pipeline_equivalence``'s bf16 tolerance is 2e-2), which would hide a W pass on
the wrong tensors.  Built on ``tests/pipeline/test_pipeline_equivalence``'s runs (same model, data, Adam, clipping).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "pipeline"))
import test_pipeline_equivalence as equivalence  # noqa: E402
from harness import run_on_ranks  # noqa: E402

ONE_CHUNK, V2, ZB = equivalence.ONE_CHUNK, equivalence.V2, equivalence.ZB


def _train(fp8: dict, **case):
    model = equivalence.MODEL
    equivalence.MODEL = dict(model, **fp8)  # the rank processes are reused: put it back
    try:
        return equivalence._train(**case)
    finally:
        equivalence.MODEL = model


TOL = 1e-5
RECIPES = {"tensorwise": dict(fp8="e4m3"), "delayed": dict(fp8="hybrid", fp8_recipe="delayed",
                                                           fp8_amax_history_len=2, fp8_amax_compute_algo="max")}


MLA = dict(position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4,
           qk_pos_emb_head_dim=4, v_head_dim=4)


@pytest.mark.parametrize("schedule,recipe,moe,mla", [("interleaved", "tensorwise", False, False),
                                                     ("zero_bubble", "delayed", False, False),
                                                     ("zero_bubble", "delayed", True, False),
                                                     ("zero_bubble", "delayed", False, True)])
def test_pipeline_schedules_with_fp8_equal_one_rank(schedule, recipe, moe, mla):
    """``moe``: every layer's MLP 4 experts in fp8, their weight gradients deferred to ZB-H1's W as well.  ``mla``:
    multi-latent attention, its up-projections' and ``o_proj``'s weight gradients deferred, its replicated
    down-projections' run in B."""
    pipeline = {"1f1b": ONE_CHUNK, "interleaved": V2, "zero_bubble": ZB}[schedule]
    fp8 = dict(RECIPES[recipe], **(MLA if mla else {}))
    ref = run_on_ranks(1, _train, fp8, pp=1, tp=1, moe=moe, steps=2)[0]
    got = run_on_ranks(2, _train, fp8, pp=2, tp=1, pipeline=pipeline, moe=moe, steps=2, timeout=300)[0]
    (losses, norms, weights, _), (ref_losses, ref_norms, ref_weights, _) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=TOL, atol=TOL)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=TOL, atol=TOL, msg=name)
