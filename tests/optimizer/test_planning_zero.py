"""``ds-megatron plan`` on DeepSpeed's optimizer path against what DeepSpeed's engine allocates, ZeRO stage by stage.

What a rank holds is measured as every live CPU tensor's storage (and leaf gradient) reachable from Python, counted
once per storage: before the model is built, after the engine is built, after the first micro-batch of two (the
accumulation window open) and after the step; and the fp32 gradients the torch optimizer is handed, from a step
pre-hook (ZeRO steps it on its fp32 partitions, one param group at a time).  DeepSpeed's buffers are seen as they are
allocated, by no name of theirs.
"""
import gc
import time
import warnings

import torch

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import GPTConfig, ParallelConfig
from ds_megatron.models.gpt import GPTModel
from ds_megatron.optimizer import get_param_groups
from ds_megatron.planning import plan_memory
from ds_megatron.planning.memory import BYTES, ZeroPlan

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300,
             hidden_dropout=0.0, attention_dropout=0.0)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
BUCKET = 10_000  # elements: small enough that the model's partitions are seen beside it
# (stage, params dtype, tp of 4 ranks, overlap_comm, expert sizes (ep, etp) or None)
CASES = [(0, "bf16", 1, None, None), (1, "fp32", 2, None, None), (1, "bf16", 2, True, None),
         (1, "bf16", 1, None, None), (2, "bf16", 2, None, (2, 1)), (3, "fp32", 2, None, None),
         (3, "bf16", 1, None, None)]


def _live_storages():
    """Every live CPU storage reachable from Python: data pointer -> (bytes, dtype, shape of one tensor on it), once
    the count has settled.  A gloo worker thread drops its reference to a finished collective's tensor on its own
    schedule, after the caller has gone on: a tensor Python has dropped can stay alive a moment longer (an all-reduced
    tensor deleted at once is still among ``gc.get_objects()`` about once in 40 here; CI once counted one rank 4 KiB
    over, an [s, b, h] fp32 TP all-reduce buffer's size).  Counted again every 50 ms until two counts agree."""
    last = _storages_now()
    for _ in range(20):
        time.sleep(0.05)
        now = _storages_now()
        if now == last:
            break
        last = now
    return last


def _storages_now():
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if obj.device.type == "cpu":
            for t in (obj, obj.grad) if obj.is_leaf else (obj,):
                if t is not None and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = (storage.nbytes(), str(t.dtype), tuple(t.shape))
    return storages


def _live_bytes():
    return sum(nbytes for nbytes, *_ in _live_storages().values())


def _zero(stage, overlap):
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "stage3_param_persistence_threshold": 0}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    return zero


def _measure(stage, dtype, tp, overlap, experts):
    megatron = {"tensor_model_parallel_size": tp, "optimizer_impl": "deepspeed"}
    if experts:
        megatron.update(expert_model_parallel_size=experts[0], expert_tensor_parallel_size=experts[1])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
           "gradient_clipping": 1.0, "zero_optimization": _zero(stage, overlap), "megatron": megatron}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    state = ds_megatron.initialize_model_parallel(cfg)
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(state.dp.rank))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    torch.manual_seed(0)
    before = _live_bytes()
    model = GPTModel(GPTConfig(**MODEL, **(MOE if experts else {})), state)
    params, largest = sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())
    one_dim = sum(p.numel() for p in model.parameters() if p.ndim < 2)  # biases and norms: a param group of their own
    optimizer = torch.optim.AdamW(get_param_groups(model), lr=1e-3)
    built, main_grads = [], []  # the fp32 gradients the optimizer is handed at each param group's step (ZeRO
    # steps them one by one), beside the engine as built

    def before_group_step(*_):
        if built:  # not the step DeepSpeed's 16-bit optimizer without ZeRO takes at construction
            main_grads.append(sum(p.grad.numel() * p.grad.element_size() for g in optimizer.param_groups
                                  for p in g["params"] if p.grad is not None))
    optimizer.register_step_pre_hook(before_group_step)
    engine, *_ = ds_megatron.initialize(model=model, optimizer=optimizer, config=cfg, parallel_state=state)
    built_storages = _live_storages()
    built.append(sum(nbytes for nbytes, *_ in built_storages.values()))
    engine.backward(engine(batch))
    engine.step()  # not the window's last micro-batch: no optimizer step
    open_window = _live_storages()
    accumulating = sum(nbytes for nbytes, *_ in open_window.values()) - built[0]
    # What the window added, for the message of a failed comparison (one run on CI once counted 4 KiB more)
    added = sorted(v for k, v in open_window.items() if k not in built_storages)
    removed = sorted(v for k, v in built_storages.items() if k not in open_window)
    engine.backward(engine(batch))
    engine.step()
    after = _live_bytes() - built[0]
    assert engine.global_steps == 1 and engine.skipped_steps == 0
    tp_rank = state.tp.rank
    engine.megatron.destroy()
    return {"tp_rank": tp_rank, "params": params, "largest": largest, "one_dim": one_dim, "built": built[0] - before,
            "accumulating": accumulating, "added": added, "removed": removed, "main_grads": main_grads, "after": after}


def _measure_all():
    return [_measure(*case) for case in CASES]


def test_plan_of_deepspeeds_zero_stages_is_what_the_engine_allocates():
    results = run_on_ranks(4, _measure_all)
    for i, (stage, dtype, tp, overlap, experts) in enumerate(CASES):
        ep, etp = experts or (1, None)
        layout = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp).layout(4)
        zero = ZeroPlan.from_section(_zero(stage, overlap))
        plans = plan_memory(GPTConfig(**MODEL, **(MOE if experts else {})), layout, dtype, "adamw",
                            micro_batch=2, zero=zero)
        for rank, got in enumerate(r[i] for r in results):
            plan = plans[got["tp_rank"]]
            what = (f"stage {stage} {dtype} tp {tp} overlap_comm {overlap} experts {experts}, rank {rank}: {got}")
            low = BYTES[dtype]
            assert rank in plan.ranks and plan.params == got["params"], what
            bucket = zero.bucket_elements() * low
            owned = plan.optimizer_state_bytes // 8  # the parameters of this rank's partition (Adam: 8 bytes each)
            # Built: the params as ZeRO holds them (flattened; stage 3: the partition) and the fp32 copies of the
            # partition (of every param at stage 0 with 16-bit params); stage 3 also makes the gradient partition
            # and its bucket now.  Up to DeepSpeed's inf/nan flag (one byte).
            built = plan.model_param_bytes + plan.main_param_bytes + (plan.grad_bytes if stage == 3 else 0)
            assert 0 <= got["built"] - built <= 16, what
            # The window open: stage 0 and 1 keep every param's gradient whole (stage 1 and its bucket(s)), stage 2
            # the gradients reduced into the partition, each of them whole when it reaches into the partition (up
            # to the largest param more; its bucket lives during backward only), stage 3 nothing new.
            if stage in (0, 1) and not overlap:
                assert got["accumulating"] == plan.grad_bytes, what
            elif stage == 1:  # overlap_comm: a reduction may still hold a piece of one gradient (seen once: 2 KiB)
                assert 0 <= got["accumulating"] - plan.grad_bytes <= got["largest"] * low, what
            elif stage == 2:
                assert 0 <= got["accumulating"] - (plan.grad_bytes - bucket) <= got["largest"] * low, what
            else:
                assert got["accumulating"] == 0, what
            # Inside the step: ZeRO hands the optimizer one param group's fp32 gradients at a time, the largest the
            # dense 2-D params' partition: the plan's dense partition without the biases and norms (their own group).
            # Stage 0 with 16-bit params: fp32 copies of every gradient at once; with fp32 params, the gradients.
            main = max(got["main_grads"])
            if stage == 0:
                assert main == (plan.main_grad_bytes if dtype != "fp32" else plan.grad_bytes), what
            else:
                assert main == plan.main_grad_bytes - 4 * -(-got["one_dim"] // layout.dp), what
            # After the step: the optimizer states of the partition (the gradients and their fp32 copies freed), the
            # torch optimizer's step counters (4 bytes per param tensor or partition) and, with MoE, the tensors the
            # model keeps from step to step (its routing losses).
            assert 0 <= got["after"] - plan.optimizer_state_bytes <= 1024, what


def test_plan_command_describes_the_zero_stage(tmp_path):
    import json
    import subprocess
    import sys
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "megatron": {"optimizer_impl": "deepspeed", "tensor_model_parallel_size": 2, "model": MODEL}}
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "plan", "--config", str(path), "--world-size", "4",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "ZeRO stage 3: params, grads, fp32 copies and optimizer states sharded over DP" in doc["header"]
    (role, _) = doc["roles"]
    owned = -(-role["params"] // 2)  # TP 2 x DP 2: each rank's partition of its TP shard
    assert role["model_param_bytes"] == 2 * owned and role["optimizer_state_bytes"] == 8 * owned
    assert role["grad_bytes"] == 2 * owned + 2 * 500_000_000  # DeepSpeed's default bucket, in bf16
