"""The engine hook: warm-up, capture, replay by micro-batch, reset on shape change; "graphs off" on CPU.

A small stand-in for DeepSpeed's engine (the attributes the hook reads:
``module``, ``global_steps``, ``micro_steps``, ``gradient_accumulation_steps()``)
drives the loop; one test goes through ``ds_megatron.initialize`` on a real
single-rank DeepSpeed engine.
"""
import copy
import logging

import pytest
import torch

from harness import run_on_ranks
from ds_megatron.config import ConfigError, CudaGraphConfig
from ds_megatron.cuda_graphs.backends import EagerCapturer
from ds_megatron.integration.cuda_graphs import attach_cuda_graphs
from ds_megatron.models import GPTConfig, GPTModel

CFG = dict(num_layers=3, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=8, vocab_size=50,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)


class FakeEngine:
    def __init__(self, module, gas, device="cpu"):
        self.module, self.gas = module, gas
        self.device = torch.device(device)
        self.global_steps = self.micro_steps = 0

    def gradient_accumulation_steps(self):
        return self.gas

    def __call__(self, *args):
        return self.module(*args)

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas == 0:
            self.global_steps += 1


def _batch(step, seq=8):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (2, seq), generator=g), torch.randint(0, 50, (2, seq), generator=g)


def _train(engine, steps, seq=8):
    losses = []
    for i in range(steps * engine.gas):
        tokens, labels = _batch(i, seq)
        loss = engine(tokens, labels)
        loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses


def test_warmup_capture_replay_and_reset_on_shape_change(caplog):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG))
    reference = copy.deepcopy(model)
    engine, ref_engine = FakeEngine(model, gas=2), FakeEngine(reference, gas=2)
    capturer = EagerCapturer()
    hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"], warmup_steps=2),
                              capturer=capturer)
    assert len(hook.helper.runners) == 3
    losses = _train(engine, 2)
    assert capturer.calls == 0 and not hook.helper.captured
    seen = []
    for runner in hook.helper.runners:
        replay = runner.replay
        runner.replay = lambda h, replay=replay, runner=runner: (seen.append(runner.current_microbatch), replay(h))[1]
    losses += _train(engine, 2)  # captured at the first micro-batch of step 2, then replayed
    assert capturer.calls == 1 and hook.num_captures == 1 and hook.helper.captured
    assert seen == [0, 0, 0, 1, 1, 1] * 2  # three layers, micro-batch index per forward
    # Same losses and accumulated grads as the plain model (no optimizer in this loop).
    assert losses == _train(ref_engine, 2) + _train(ref_engine, 2)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    # A new sequence length: graphs dropped (no replay at the wrong shape), recaptured after warmup_steps.
    with caplog.at_level(logging.INFO, logger="ds_megatron.cuda_graphs"):
        _train(engine, 1, seq=6)
    assert not hook.helper.captured and "changed shape" in caplog.text
    _train(engine, 2, seq=6)
    assert capturer.calls == 2
    hook.detach()
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_eval_and_no_grad_forwards_run_eagerly():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**CFG))
    engine = FakeEngine(model, gas=1)
    hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", warmup_steps=1),
                              capturer=EagerCapturer())
    _train(engine, 2)
    assert hook.helper.captured
    model.eval()
    with torch.no_grad():
        tokens, labels = _batch(0)
        model(tokens, labels)
    assert all(not r.stale for r in hook.helper.runners)


def test_graphs_off_line_on_cpu_exactly_once(caplog):
    engine = FakeEngine(GPTModel(GPTConfig(**CFG)), gas=1)
    with caplog.at_level(logging.INFO, logger="ds_megatron.cuda_graphs"):
        hook = attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"]))
        _train(engine, 4)
    assert hook is None
    lines = [r.getMessage() for r in caplog.records if r.name == "ds_megatron.cuda_graphs"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("CUDA graphs are off") and "the engine runs on the CPU" in lines[0]
    assert "eagerly" in lines[0]
    assert all("forward" not in layer.__dict__ for layer in engine.module.layers)


def test_graphs_stay_off_for_a_cpu_engine_on_a_gpu_machine(monkeypatch, caplog):
    """The engine's device decides, not whether the machine has a GPU: a job pinned to the CPU
    (DS_ACCELERATOR=cpu, as the tests are) on a GPU machine trains eagerly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = FakeEngine(GPTModel(GPTConfig(**CFG)), gas=1)
    with caplog.at_level(logging.INFO, logger="ds_megatron.cuda_graphs"):
        assert attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", scope=["attn"])) is None
    assert "the engine runs on the CPU" in caplog.text
    with pytest.raises(ConfigError, match="the engine runs on the CPU"):
        attach_cuda_graphs(engine, CudaGraphConfig(impl="local", required=True))


def test_required_graphs_fail_at_start_on_cpu():
    engine = FakeEngine(GPTModel(GPTConfig(**CFG)), gas=1)
    with pytest.raises(ConfigError, match="megatron.cuda_graph.required is true"):
        attach_cuda_graphs(engine, CudaGraphConfig(impl="transformer_engine", required=True))


def test_none_attaches_nothing():
    engine = FakeEngine(GPTModel(GPTConfig(**CFG)), gas=1)
    assert attach_cuda_graphs(engine, CudaGraphConfig(impl="none")) is None


def _initialize_with_graphs():
    import ds_megatron
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("ds_megatron.cuda_graphs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000,
                  "megatron": {"optimizer_impl": "deepspeed",
                               "cuda_graph": {"impl": "transformer_engine", "scope": ["attn"], "warmup_steps": 1}}}
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**CFG))
        engine, _, _, _ = ds_megatron.initialize(model=model, model_parameters=model.parameters(), config=config)
        for i in range(3):
            tokens, labels = _batch(i)
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
        return engine.megatron.cuda_graphs, [r.getMessage() for r in records], float(loss)
    finally:
        log.removeHandler(handler)


def test_initialize_registers_the_hook_and_says_graphs_are_off_once():
    (hook, lines, loss), (_, other_rank_lines, _) = run_on_ranks(2, _initialize_with_graphs)
    assert hook is None and loss == loss
    assert len(lines) == 1 and lines[0].startswith("CUDA graphs are off"), lines
    assert other_rank_lines == [], "the line is for the job: rank 0 only"
