"""``ds-megatron train --config FILE``: a full GPT training job through the plain DeepSpeed loop.

Data (embedded stdlib corpus or a preprocessed ``.bin/.idx``), the TP GPT
model, ``ds_megatron.initialize``, then for every step
``engine(batch)`` / ``engine.backward(loss)`` / ``engine.step()`` over the
gradient-accumulation micro-batches; LR warmup + cosine decay, periodic
validation, checkpoints every ``save_interval`` steps and ``--resume`` from
the latest one, a rank-0 progress bar, ``metrics.jsonl`` and ``loss_curve.png``
in the output directory.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..config import ConfigError, world_size_from_env
from .config import JobConfig, parse_job_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-megatron train", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON config with a \"megatron\" section")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output dir")
    p.add_argument("--output-dir", help="where checkpoints, metrics.jsonl and loss_curve.png go "
                                        "(default: megatron.train.output_dir)")
    p.add_argument("--train-iters", type=int, help="override megatron.train.train_iters")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    return p


def load_job(config_path: str, world_size: int, train_iters: Optional[int] = None,
             output_dir: Optional[str] = None) -> JobConfig:
    """Parse and validate every section for ``world_size`` ranks; creates nothing."""
    job = parse_job_config(config_path)
    layout = job.megatron.layout(world_size)
    job.model.check_tensor_parallel(layout.tp)
    job.model.check_expert_parallel(layout.ep, layout.etp)  # MoE: num_experts % EP, moe_ffn % ETP
    if train_iters is not None:
        if train_iters < 1:
            raise ConfigError(f"--train-iters must be >= 1, got {train_iters}")
        job.train.train_iters = train_iters
    if output_dir is not None:
        job.train.output_dir = output_dir
    return job


def _param_groups(model) -> List[Dict[str, Any]]:
    """Megatron's rule: no weight decay for biases and LayerNorm weights (every 1-D parameter)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class TrainResult:
    losses: Dict[int, float] = field(default_factory=dict)  # step -> DP-averaged train loss
    val_losses: Dict[int, float] = field(default_factory=dict)
    start_step: int = 0


def train(job: JobConfig, config_source, resume: bool = False, stop_after: Optional[int] = None,
          show_progress: bool = True) -> TrainResult:
    """Run the job on an already launched set of ranks; returns the losses it saw.

    ``stop_after``: end after this step (simulates an interruption; tests use it).
    """
    import torch
    import torch.distributed as dist

    import ds_megatron
    from ..data.corpus import build_default_dataset
    from ..data.gpt_dataset import build_train_valid_datasets
    from ..data.sampler import build_data_loader
    from ..models.gpt import GPTModel
    from ..optimizer import get_grad_norm_fp32, grads_for_norm
    from ..tensor_parallel import RNGStatesTracker, model_parallel_seed
    from .checkpointing import load_checkpoint, save_checkpoint
    from .lr_schedule import build_lr_scheduler
    from .metrics import MetricsLog, plot_loss_curve, progress_text

    tcfg, out_dir = job.train, job.train.output_dir
    state = ds_megatron.initialize_model_parallel(job.megatron)
    rank, dp = dist.get_rank(), state.dp
    tracker = model_parallel_seed(tcfg.seed, state.tp.rank, state.pp.rank, state.ep.rank, state.etp.rank,
                                  tracker=RNGStatesTracker())
    model = GPTModel(job.model, state, rng_tracker=tracker)

    ds_config = job.ds_config
    mbs = ds_config["train_micro_batch_size_per_gpu"]
    gas = ds_config.get("gradient_accumulation_steps", 1)
    global_batch = mbs * gas * dp.size
    if "optimizer" in ds_config:
        optimizer, scheduler = None, None  # DeepSpeed builds both from its own sections
    else:
        optimizer = torch.optim.AdamW(_param_groups(model), lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2),
                                      eps=tcfg.adam_eps, weight_decay=tcfg.weight_decay)
        scheduler = build_lr_scheduler(optimizer, tcfg.lr, tcfg.min_lr, tcfg.lr_warmup_iters, tcfg.train_iters,
                                       tcfg.lr_decay_style)
    engine, _, _, scheduler = ds_megatron.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config_source,
        model_parameters=_param_groups(model) if optimizer is None else None, parallel_state=state)

    start_step, consumed = 0, 0
    if resume:
        client = load_checkpoint(engine, out_dir, tracker)
        if client is not None:
            start_step, consumed = client["step"], client["consumed_train_samples"]

    prefix = job.data.data_path or build_default_dataset(max_bytes=job.data.default_corpus_bytes,
                                                         tokenizer=job.data.tokenizer)
    train_ds, valid_ds = build_train_valid_datasets(
        prefix, job.model.seq_length, job.data.split, tcfg.seed, train_samples=tcfg.train_iters * global_batch,
        valid_samples=tcfg.eval_iters * mbs * dp.size)
    train_loader = build_data_loader(train_ds, mbs, dp.rank, dp.size, consumed, job.data.num_workers,
                                     job.data.dataloader_type, tcfg.seed)
    train_iter = iter(train_loader)

    def dp_mean(value: torch.Tensor) -> float:
        value = value.detach().clone().double()
        dist.all_reduce(value, group=dp.group)
        return float(value) / dp.size

    def evaluate() -> float:
        engine.eval()
        total, n = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for batch in build_data_loader(valid_ds, mbs, dp.rank, dp.size, 0):
                total += engine(batch).double()
                n += 1
        engine.train()
        return dp_mean(total / max(n, 1))

    log = MetricsLog(os.path.join(out_dir, "metrics.jsonl")) if rank == 0 else None
    result = TrainResult(start_step=start_step)
    bar = None
    if rank == 0 and show_progress and sys.stdout.isatty():
        from tqdm import tqdm
        bar = tqdm(total=tcfg.train_iters, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stdout,
                   mininterval=0.5)
    tokens_per_step = global_batch * job.model.seq_length
    # Our optimizer path (and DeepSpeed's own fp16/bf16/ZeRO optimizers) report the true global norm
    # through engine.get_global_grad_norm(); only DeepSpeed's plain fp32 path leaves it to the loop.
    from ..optimizer import MegatronOptimizer
    own_grad_norm = not (isinstance(engine.optimizer, MegatronOptimizer) or engine.fp16_enabled()
                         or engine.bfloat16_enabled() or engine.zero_optimization())
    last = start_step
    if valid_ds is not None and start_step == 0:
        val = evaluate()  # the starting point of the validation curve
        result.val_losses[0] = val
        if log is not None:
            log.write({"step": 0, "val_loss": val})
        if rank == 0 and show_progress:
            print(f"step 0: validation loss {val:.4f}", flush=True)
    for step in range(start_step, tcfg.train_iters):
        t0 = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64)
        gnorm = None
        for micro in range(gas):
            loss = engine(next(train_iter))
            engine.backward(loss)
            if micro == gas - 1 and own_grad_norm:
                # Grads are DP-reduced now and still unclipped: Megatron's true global norm.
                gnorm = get_grad_norm_fp32(grads_for_norm(model.parameters(), state.tp.rank), state.mp.group)
            engine.step()
            step_loss += loss.detach().double() / gas
        consumed += global_batch
        loss_value = dp_mean(step_loss)
        tok_s = tokens_per_step / (time.perf_counter() - t0)
        lr = engine.get_lr()[0]
        if gnorm is None and engine.get_global_grad_norm() is not None:
            gnorm = float(engine.get_global_grad_norm())
        loss_scale = getattr(engine.optimizer, "cur_scale", None)  # DeepSpeed's name; ours and its fp16 one
        result.losses[step + 1] = loss_value
        # MoE: this step's routing losses (included in the loss), logged on their own
        moe_losses = {}
        if model.moe_aux_loss_tracker is not None:
            moe_losses = {k: dp_mean(torch.tensor(v)) for k, v in model.moe_aux_loss_tracker.averages().items()}
            model.moe_aux_loss_tracker.reset()
        moe_text = "".join(f" | {k} {v:.4f}" for k, v in moe_losses.items())
        if log is not None and (step + 1) % tcfg.log_interval == 0:
            log.write({"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tok_s,
                       "consumed_samples": consumed, "loss_scale": loss_scale,
                       "skipped_steps": engine.skipped_steps, **moe_losses})
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(progress_text(step + 1, loss_value, lr, tok_s, gnorm, loss_scale))
        elif rank == 0 and show_progress and ((step + 1) % 10 == 0 or step == start_step):
            print(f"step {step + 1}/{tcfg.train_iters} | "
                  + progress_text(step + 1, loss_value, lr, tok_s, gnorm, loss_scale) + moe_text, flush=True)
        if valid_ds is not None and ((step + 1) % tcfg.eval_interval == 0 or step + 1 == tcfg.train_iters):
            val = evaluate()
            result.val_losses[step + 1] = val
            if log is not None:
                log.write({"step": step + 1, "val_loss": val})
            if rank == 0 and show_progress:
                (bar.write if bar is not None else print)(f"step {step + 1}: validation loss {val:.4f}")
        done = step + 1 == tcfg.train_iters or step + 1 == stop_after
        if (tcfg.save_interval and (step + 1) % tcfg.save_interval == 0) or done:
            save_checkpoint(engine, out_dir, step + 1, {"step": step + 1, "consumed_train_samples": consumed},
                            tracker)
        last = step + 1
        if step + 1 == stop_after:
            break
    if bar is not None:
        bar.close()
    if rank == 0 and last == tcfg.train_iters:
        why_not = plot_loss_curve(log.read(), os.path.join(out_dir, "loss_curve.png"))
        print(why_not or f"loss curve: {os.path.join(out_dir, 'loss_curve.png')}", flush=True)
        vals = {r["step"]: r["val_loss"] for r in log.read() if "val_loss" in r}
        if len(vals) > 1:
            first, last_step = min(vals), max(vals)
            print(f"validation loss: {vals[first]:.4f} at step {first} -> {vals[last_step]:.4f} at step {last_step}",
                  flush=True)
    engine.megatron.state.destroy()
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, _ = build_parser().parse_known_args(argv)
    try:
        job = load_job(args.config, world_size_from_env() or 1, args.train_iters, args.output_dir)
    except ConfigError as e:
        print(f"ds-megatron train: error: {e}", file=sys.stderr)
        return 2
    train(job, args.config, resume=args.resume)
    _shutdown()
    return 0


def _shutdown() -> None:
    """Leave the job cleanly: barrier, destroy the default group, then skip interpreter teardown.

    Interpreter teardown under gloo sometimes aborts ("terminate called without
    an active exception"), which a launcher would report as a failed run.
    """
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
