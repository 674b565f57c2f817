"""Graphed vs eager on a CUDA device, for dense and MoE layers and every scope (skipped without CUDA).

Captures through torch.cuda.make_graphed_callables, and through Transformer
Engine's make_graphed_callables when it imports.
"""
import copy

import pytest
import torch

from ds_megatron.config import CudaGraphConfig
from ds_megatron.cuda_graphs.backends import TorchCapturer, TransformerEngineCapturer, import_transformer_engine_graph_api
from ds_megatron.cuda_graphs.capture import CudaGraphHelper
from ds_megatron.models import GPTConfig, GPTModel

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DENSE = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=32, vocab_size=128,
             hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
MOE = dict(DENSE, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_grouped_gemm=False)
MLA = dict(DENSE, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=8, position_embedding_type="rope", normalization="RMSNorm", rope_scaling_type="yarn",
           rope_scaling_factor=4.0, original_max_position_embeddings=8, yarn_mscale=0.7, yarn_mscale_all_dim=1.0)


def _capturers():
    out = [pytest.param(TorchCapturer, id="torch")]
    te, why = import_transformer_engine_graph_api()
    out.append(pytest.param(TransformerEngineCapturer, id="te",
                            marks=pytest.mark.skipif(te is None, reason=why or "transformer_engine missing")))
    return out


def _step(model, step):
    g = torch.Generator(device="cuda").manual_seed(step)
    tokens = torch.randint(0, 128, (2, 32), device="cuda", generator=g)
    labels = torch.randint(0, 128, (2, 32), device="cuda", generator=g)
    loss = model(tokens, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("capturer", _capturers())
@pytest.mark.parametrize("model_cfg, scope", [
    (DENSE, []), (DENSE, ["attn"]), (MLA, ["attn"]),
    (MOE, ["attn", "moe_router"]), (MOE, ["attn", "moe_router", "moe_preprocess"]),
    (MOE, ["moe_router", "moe_preprocess"]),
])
def test_graphed_equals_eager(capturer, model_cfg, scope):
    torch.manual_seed(0)
    eager = GPTModel(GPTConfig(**model_cfg)).cuda()
    graphed = copy.deepcopy(eager)
    helper = CudaGraphHelper(list(graphed.layers), CudaGraphConfig(impl="transformer_engine", scope=scope),
                             capturer())
    _step(graphed, 100)
    helper.create_cudagraphs()
    for step in range(3):
        ref_loss, ref_grads = _step(eager, step)
        loss, grads = _step(graphed, step)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("capturer", _capturers())
@pytest.mark.parametrize("model_cfg, scope", [(DENSE, ["attn"]), (DENSE, []),
                                              (MOE, ["attn", "moe_router", "moe_preprocess"])])
def test_capture_while_the_callers_last_loss_is_alive(capturer, model_cfg, scope):
    """A training loop holds its last loss, and with it the last step's autograd graph, when the next
    forward captures (``loss = engine(batch)`` rebinds only after the call): capture must work then,
    and training with graphs must follow the eager run step for step."""
    torch.manual_seed(0)
    eager = GPTModel(GPTConfig(**model_cfg)).cuda()
    graphed = copy.deepcopy(eager)
    helper = CudaGraphHelper(list(graphed.layers), CudaGraphConfig(impl="transformer_engine", scope=scope),
                             capturer())
    runs = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, loss = [], None
        for step in range(6):
            if name == "graphed" and step == 2:
                assert loss is not None and loss.grad_fn is not None  # the previous graph is alive
                helper.create_cudagraphs()
            g = torch.Generator(device="cuda").manual_seed(step)
            tokens = torch.randint(0, 128, (2, 32), device="cuda", generator=g)
            labels = torch.randint(0, 128, (2, 32), device="cuda", generator=g)
            loss = model(tokens, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        runs[name] = losses
    assert helper.captured
    assert runs["graphed"] == pytest.approx(runs["eager"], rel=1e-5, abs=1e-6)


def _fp8_gemm_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_gemm_supported(), reason="torch._scaled_mm needs compute capability 8.9 or newer")
@pytest.mark.parametrize("capturer", _capturers())
@pytest.mark.parametrize("recipe, scope", [("tensorwise", ["attn"]), ("tensorwise", []), ("delayed", ["attn"]),
                                           ("delayed", [])])
def test_graphed_fp8_training_follows_eager(capturer, recipe, scope):
    """fp8 GEMMs inside the graphs (widths and tokens multiples of 16, cuBLASLt's fp8 GEMM): the graphed model
    trains as the eager one step for step, the delayed scales advancing between steps outside the graphs, in place
    (the replays read the storages of the capture).  E4M3 output gradients (~1e-4 here) underflow to 0 at a
    stale scale of 1, so a replay that read an old scale would move the gradients far beyond the tolerance."""
    from ds_megatron.fp8 import delayed_scaling_groups, update_delayed_scaling
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.tensor_parallel.layers import fp8_states
    torch.manual_seed(0)
    eager = GPTModel(GPTConfig(**DENSE, fp8="e4m3", fp8_recipe=recipe)).cuda().bfloat16()
    graphed = copy.deepcopy(eager)
    helper = CudaGraphHelper(list(graphed.layers), CudaGraphConfig(impl="transformer_engine", scope=scope),
                             capturer())
    groups = delayed_scaling_groups(ParallelState.single())
    storages = [t.untyped_storage().data_ptr() for s in fp8_states(graphed) for t in s.state_tensors()]
    runs = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, grads, scales = [], [], []
        for step in range(5):
            if name == "graphed" and step == 1:
                helper.create_cudagraphs()
            loss, step_grads = _step(model, step)
            update_delayed_scaling(fp8_states(model), groups)
            for n, p in model.named_parameters():
                p.grad = step_grads.get(n)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
            grads.append(step_grads)
            scales.append(torch.stack([s.scale[r] for s in fp8_states(model) if s.recipe.recipe == "delayed"
                                       for r in s.scale]) if recipe == "delayed" else torch.ones(1, device="cuda"))
        runs[name] = losses, grads, scales
    assert helper.captured
    (losses, grads, scales), (ref_losses, ref_grads, ref_scales) = runs["graphed"], runs["eager"]
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    for step in range(1, 5):
        assert grads[step].keys() == ref_grads[step].keys()
        for n, want in ref_grads[step].items():
            err = ((grads[step][n].float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
            assert err < 1e-2, f"step {step}: {n} off by {err:.2e}"
        torch.testing.assert_close(scales[step], ref_scales[step], rtol=1e-2, atol=0)
    if recipe == "delayed":
        assert not torch.equal(scales[-1], torch.ones_like(scales[-1]))  # the scales moved
    assert [t.untyped_storage().data_ptr() for s in fp8_states(graphed) for t in s.state_tensors()] == storages
