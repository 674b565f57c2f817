"""The distributed optimizer inside DeepSpeed's engine, on gloo ranks.

Reference: the same model, data and config with the non-distributed optimizer
(``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``).  The distributed
run uses small buckets, so params are cut between ranks and between buckets.
"""
import functools
import json
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.config import ConfigError
from ds_megatron.distributed import DistributedDataParallelConfig
from ds_megatron.optimizer import DistributedOptimizer
from ds_megatron.integration.optimizer import prepare_optimizer_path
from ds_megatron.checkpointing import api as checkpoints
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

CLIP = 0.05  # well below the grad norms here (~0.25), so clipping acts on every step
GLOBAL_BATCH = 8


class MLP(torch.nn.Module):
    """Odd sizes, so that shards and buckets cut through params."""

    def __init__(self, width=24):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Linear(16, width)
        self.b = torch.nn.Linear(width, 8)
        self.c = torch.nn.Linear(8, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        x = x.to(self.a.weight.dtype)
        return torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))).float().pow(2).mean()


def _config(megatron, precision=None, gas=1, clip=CLIP):
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // (gas * dist.get_world_size()),
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "gradient_clipping": clip, "steps_per_print": 10 ** 6, "megatron": dict(megatron), **(precision or {})}


DIST = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
OVERLAP = {**DIST, "overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": 200}


def _micro_batch(step, micro, gas):
    """This rank's part of global batch ``step``: the same GLOBAL_BATCH samples whatever DP and gas are."""
    mbs = GLOBAL_BATCH // (gas * dist.get_world_size())
    first = step * GLOBAL_BATCH + (micro * dist.get_world_size() + dist.get_rank()) * mbs
    return torch.stack([torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(first, first + mbs)])


def _engine(cfg):
    state = ds_megatron.initialize_model_parallel(cfg)
    model = MLP()
    engine, opt, _, _ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    return engine, opt, model, state


def _close(engine, state):
    if engine.megatron.ddp_in_engine is not None:
        engine.megatron.ddp_in_engine.detach()
    state.destroy()


def _train_steps(engine, steps, start=0):
    gas = engine.gradient_accumulation_steps()
    losses, norms = {}, []
    for step in range(start, start + steps):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(gas):
            loss = engine(_micro_batch(step, micro, gas))
            engine.backward(loss)
            engine.step()
            total += loss.detach().double() / gas
        dist.all_reduce(total)
        losses[step + 1] = float(total) / dist.get_world_size()
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _flat_params(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _shard_map(opt):
    """Each local piece: (index of the param in model order, gbuf_world range, param range)."""
    index = {p: i for i, p in enumerate(p for g in opt.model_params_in_groups for p in g)}
    out = []
    for param, (gbuf_index, dtype, bucket) in opt.model_param_gbuf_map.items():
        r = opt.gbuf_ranges[gbuf_index][dtype][bucket]["param_map"][param]
        assert r["gbuf_world"].size == r["gbuf_local"].size == r["param"].size == r["gbuf_world_in_bucket"].size
        start = opt.buffers[gbuf_index].param_index_map[param][0]
        assert r["gbuf_world"].start == start + r["param"].start  # the param range is the world range shifted
        assert r["gbuf_world"].start - r["gbuf_world_in_bucket"].start == opt.buffers[gbuf_index].buckets[bucket].offset
        out.append((index[param], r["param"].start, r["param"].end, param.numel()))
    return out


def _equivalence_body():
    """fp32 (overlapped reduce-scatter and param gather, 200-element buckets) and bf16 (one bucket)."""
    out = {}
    for name, precision, megatron in (("fp32", {}, OVERLAP), ("bf16", {"bf16": {"enabled": True}}, DIST)):
        runs = {}
        for kind, section in (("ref", {}), ("dist", megatron)):
            engine, opt, model, state = _engine(_config(section, precision))
            _, norms = _train_steps(engine, 3)
            sd = opt.state_dict()
            runs[kind] = dict(params=_flat_params(model), norms=norms, sd=sd, opt=type(opt).__name__,
                              bytes=opt.state_bytes(), n_buckets=sum(len(b.buckets) for b in getattr(opt, "buffers", [])),
                              shard_map=_shard_map(opt) if kind == "dist" else None,
                              padding=sum(b.numel - sum(p.numel() for p in b.params) for b in getattr(opt, "buffers", [])))
            _close(engine, state)
        out[name] = runs
    return out


@functools.lru_cache(maxsize=None)
def _equivalence(world):
    return run_on_ranks(world, _equivalence_body)


def _assert_state_dicts_close(a, b, rtol, atol):
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert sorted(a["optimizer"]["state"]) == sorted(b["optimizer"]["state"])
    for i, entries in a["optimizer"]["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(value, b["optimizer"]["state"][i][key], rtol=rtol, atol=atol)
    for ga, gb in zip(a.get("fp32_from_fp16_params", []), b.get("fp32_from_fp16_params", [])):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_optimizer_matches_the_non_distributed_one_in_the_engine(world):
    results = _equivalence(world)
    for name in ("fp32", "bf16"):
        ref, dist_ = results[0][name]["ref"], results[0][name]["dist"]
        assert dist_["opt"] == "DistributedOptimizer" and ref["opt"] != "DistributedOptimizer"
        assert all(r[name]["dist"]["params"].equal(dist_["params"]) for r in results), "ranks disagree"
        # Clipping acted, and the norm over shards (summed over the job) is the full norm.
        assert min(ref["norms"]) > 2 * CLIP
        # Each reduced grad element sums the same DP addends in another order: (DP - 1) x eps32 / 2 of their
        # size, ~2e-7 at DP=4; the norm averages that over ~750 elements (seen <= 5e-8 relative).
        assert dist_["norms"] == pytest.approx(ref["norms"], rel=1e-6)
        # Only the reduction order differs (reduce-scatter of fp32 grads vs all-reduce); seen <= 6e-8.
        torch.testing.assert_close(dist_["params"], ref["params"], rtol=1e-5, atol=1e-6 if name == "fp32" else 1e-2)
        # The gathered checkpoint is the non-distributed optimizer's, value for value.
        _assert_state_dicts_close(dist_["sd"], ref["sd"], rtol=1e-4, atol=1e-6)
        assert not ref["params"].equal(_flat_params(MLP()).to(ref["params"].dtype)), "nothing was trained"
    assert results[0]["fp32"]["dist"]["n_buckets"] > 1


@pytest.mark.parametrize("world", [2, 4])
def test_every_param_element_is_owned_by_exactly_one_rank(world):
    results = _equivalence(world)
    owned = {}
    for r in results:
        for index, start, end, numel in r["bf16"]["dist"]["shard_map"]:
            owned.setdefault(index, (numel, []))[1].append((start, end))
    assert len(owned) == 6
    for index, (numel, pieces) in owned.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == numel, (index, pieces)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), (index, pieces)  # tiled, no overlap


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_memory_per_rank_is_one_over_dp(world):
    results = _equivalence(world)
    ref = results[0]["bf16"]["ref"]["bytes"]
    dist_bytes = [r["bf16"]["dist"]["bytes"] for r in results]
    # Every element's fp32 main param and Adam moments live on exactly one rank; only the per-param
    # step counters (4 bytes) repeat on each rank holding a piece of a param.
    assert sum(b["main_params"] for b in dist_bytes) == ref["main_params"] > 0
    n_pieces = sum(len(r["bf16"]["dist"]["shard_map"]) for r in results)
    assert sum(b["optimizer_state"] for b in dist_bytes) == ref["optimizer_state"] + 4 * (n_pieces - 6)
    # Per rank: 1/DP of the non-distributed bytes, give or take the elements left unused by alignment
    # (each would hold a main param and two moments, 12 bytes) and the step counters.
    padding = results[0]["bf16"]["dist"]["padding"]
    for b in dist_bytes:
        assert abs(b["total"] - ref["total"] / world) <= 12 * padding + 4 * 6, (b, ref, padding)


def _overflow_body():
    cfg = _config(DIST, {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    engine, opt, model, state = _engine(cfg)
    _train_steps(engine, 1)
    before = _flat_params(model)
    sd_before = opt.state_dict()
    scale = opt.cur_scale
    loss = engine(_micro_batch(1, 0, 1))
    engine.backward(loss)
    if dist.get_rank() == 1:
        # Only this rank's reduced shard is bad: every other rank sees clean grads.
        param = next(iter(opt.model_param_gbuf_map))
        param.main_grad.view(-1)[opt._get_model_param_range_map(param)["param"].start] = float("inf")
    engine.step()
    out = dict(overflow=opt.overflow, skipped=engine.skipped_steps, scale=(scale, opt.cur_scale),
               same=_flat_params(model).equal(before), state_same=None)
    sd_after = opt.state_dict()
    out["state_same"] = all(sd_after["optimizer"]["state"][i][k].equal(v)
                            for i, e in sd_before["optimizer"]["state"].items() for k, v in e.items())
    out["main_same"] = all(x.equal(y) for gx, gy in zip(sd_before["fp32_from_fp16_params"],
                                                        sd_after["fp32_from_fp16_params"]) for x, y in zip(gx, gy))
    _train_steps(engine, 1, start=2)
    out["moved_after"] = not _flat_params(model).equal(before)
    _close(engine, state)
    return out


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    for res in run_on_ranks(2, _overflow_body):
        assert res["overflow"] and res["skipped"] == 1
        assert res["same"] and res["state_same"] and res["main_same"], res  # bit-identical
        assert res["scale"] == (256.0, 128.0)
        assert res["moved_after"]


def _checkpoint_body(save_dir, precision, steps, save_at, resume, load_optimizer_states=True):
    """Train ``steps`` global batches (after resuming from ``save_dir`` if asked), saving at ``save_at``."""
    gas = 4 // dist.get_world_size()  # global batch of 8 = 2 samples x gas x DP whatever DP is
    engine, opt, model, state = _engine(_config(DIST, precision, gas=gas))
    start, loaded = 0, None
    if resume:
        if load_optimizer_states:
            client = checkpoints.load(engine, save_dir)
        else:
            _, client = engine.load_checkpoint(save_dir, tag=open(os.path.join(save_dir, "latest")).read(),
                                               load_optimizer_states=False)
        start = client["step"]
    if resume and load_optimizer_states:
        ckpt = torch.load(os.path.join(save_dir, f"iter_{start:07d}", "mp_rank_00_model_states.pt"),
                          weights_only=False)
        now = opt.state_dict()
        loaded = (ckpt["dp_world_size"],
                  all(now["optimizer"]["state"][i][k].equal(v)
                      for i, e in ckpt["optimizer"]["optimizer"]["state"].items() for k, v in e.items()),
                  all(x.equal(y) for gx, gy in zip(ckpt["optimizer"].get("fp32_from_fp16_params", []),
                                                   now.get("fp32_from_fp16_params", [])) for x, y in zip(gx, gy)))
    losses = {}
    for step in range(start, steps):
        losses.update(_train_steps(engine, 1, start=step)[0])
        if step + 1 == save_at:
            checkpoints.save(engine, save_dir, step + 1, {"step": step + 1})
    _close(engine, state)
    return losses, loaded


@pytest.mark.parametrize("precision,saved_dp,resumed_dp", [({}, 4, 2), ({"bf16": {"enabled": True}}, 2, 4)],
                         ids=["fp32-dp4-to-dp2", "bf16-dp2-to-dp4"])
def test_checkpoint_resumes_with_another_dp_size(tmp_path, precision, saved_dp, resumed_dp):
    full = run_on_ranks(4, _checkpoint_body, str(tmp_path / "full"), precision, 6, None, False)[0][0]
    cut = str(tmp_path / "cut")
    first = run_on_ranks(saved_dp, _checkpoint_body, cut, precision, 3, 3, False)[0][0]
    second, loaded = run_on_ranks(resumed_dp, _checkpoint_body, cut, precision, 6, None, True)[0]
    assert sorted(second) == [4, 5, 6]
    # The resharded state is exactly what was saved (gathered back, bit for bit).
    assert loaded == (saved_dp, True, True)
    # DP=2 x 2 micro-batches and DP=4 x 1 sum the same fp32 grads in another order (seen: 3e-8 relative
    # in fp32); bf16 params would round such a difference to a whole bf16 step (seen: none here).
    rel = 1e-6 if not precision else 1e-4
    for step in range(1, 4):
        assert first[step] == pytest.approx(full[step], rel=rel), step
    for step in range(4, 7):
        assert second[step] == pytest.approx(full[step], rel=rel), step
    if not precision:
        # Guard: resuming without the optimizer state (Adam moments) visibly leaves the uninterrupted run.
        fresh, _ = run_on_ranks(resumed_dp, _checkpoint_body, cut, precision, 6, None, True, False)[0]
        assert max(abs(fresh[s] - full[s]) / full[s] for s in range(4, 7)) > 100 * rel


def _job_config(out_dir, world, save_interval=0, tp=1, precision=None, clip=1.0, megatron=DIST):
    """The GPT job, bf16 with the distributed optimizer by default; 8 samples per step for any DP size."""
    dp = world // tp
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // dp,
            "gradient_clipping": clip, "steps_per_print": 10 ** 6,
            **({"bf16": {"enabled": True}} if precision is None else precision),
            "megatron": {**megatron, "tensor_model_parallel_size": tp,
                         "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
                                   "vocab_size": 257, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                         "train": {"train_iters": 8, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2,
                                   "eval_interval": 1000, "eval_iters": 1, "save_interval": save_interval,
                                   "output_dir": out_dir},
                         "data": {"default_corpus_bytes": 1_000_000, "split": "90,10"}}}


def _job(cfg, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size())
    return train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False).losses


def test_training_job_resumes_a_dp4_checkpoint_on_dp2(tmp_path):
    """``ds-megatron train --resume`` on half the ranks, accumulation doubled: the same global batches."""
    full = run_on_ranks(4, _job, _job_config(str(tmp_path / "full"), 4))[0]
    cut = str(tmp_path / "cut")
    first = run_on_ranks(4, _job, _job_config(cut, 4, save_interval=4), False, 4)[0]
    second = run_on_ranks(2, _job, _job_config(cut, 2, save_interval=4), True)[0]
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    # Bit-exact here (bf16 params absorb the fp32 reduction-order differences); allow float tolerance.
    for step in range(1, 9):
        assert {**first, **second}[step] == pytest.approx(full[step], rel=1e-4), step


def test_gpt_with_tensor_parallelism_matches_the_non_distributed_optimizer(tmp_path):
    """TP=2 x DP=2 GPT, fp32, clipping at 0.1: TP-split shards and replicated (LayerNorm) shards
    enter the norm once each, so norms, clipping and losses agree with the non-distributed run."""
    runs = {}
    for name, megatron in (("ref", {}), ("dist", OVERLAP)):
        cfg = _job_config(str(tmp_path / name), 4, tp=2, precision={}, clip=0.1, megatron=megatron)
        losses = run_on_ranks(4, _job, cfg)[0]
        metrics = [json.loads(line) for line in open(os.path.join(str(tmp_path / name), "metrics.jsonl"))
                   if '"loss"' in line]
        runs[name] = (losses, [m["grad_norm"] for m in metrics])
    (ref_losses, ref_norms), (losses, norms) = runs["ref"], runs["dist"]
    assert min(ref_norms) > 0.2, ref_norms  # clipping acted on every step
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    for step in ref_losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), step


def test_invalid_distributed_optimizer_settings_fail_at_start():
    with pytest.raises(ConfigError, match="use_distributed_optimizer is true with megatron.optimizer_impl='deepspeed'"):
        ds_megatron.validate_config({"megatron": {"use_distributed_optimizer": True, "optimizer_impl": "deepspeed"}},
                                    world_size=2)
    with pytest.raises(ConfigError, match="use_megatron_ddp is false but megatron.use_distributed_optimizer"):
        ds_megatron.validate_config({"megatron": {"use_distributed_optimizer": True, "use_megatron_ddp": False}},
                                    world_size=2)
    with pytest.raises(ConfigError, match="zero_optimization.stage=1"):
        ds_megatron.validate_config({"zero_optimization": {"stage": 1},
                                     "megatron": {"use_distributed_optimizer": True}}, world_size=2)
    ds_config, mcfg = ds_megatron.validate_config({"megatron": {"use_distributed_optimizer": True}}, world_size=1)
    with pytest.raises(ConfigError, match="no optimizer to shard"):
        prepare_optimizer_path(ds_config, mcfg, MLP(), None, None)
    with pytest.raises(ConfigError, match="no model= was given"):
        prepare_optimizer_path(ds_config, mcfg, None, None, None)


def test_wrapping_rejects_a_ddp_without_sharding_and_an_optimizer_with_state():
    class Chunk:
        def __init__(self, **kwargs):
            self.ddp_config = DistributedDataParallelConfig(**kwargs)
    model = MLP()
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), [Chunk()])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).backward()
    sgd.step()
    with pytest.raises(ValueError, match="already has state"):
        DistributedOptimizer(sgd, [Chunk(use_distributed_optimizer=True)])
