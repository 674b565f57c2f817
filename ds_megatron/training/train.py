"""``ds-megatron train --config FILE``: a full GPT training job through the plain DeepSpeed loop.

``train`` runs named phases over one running state (``Trainer``):

* **build** (``training.build``): groups, the TP GPT (this rank's ``GPTModelChunks`` with PP),
  AdamW and the warmup + decay schedule, ``ds_megatron.initialize``; then ``--resume`` from the
  latest checkpoint, and the data (embedded stdlib corpus or a preprocessed ``.bin/.idx``) from
  the consumed position on;
* **step** (``training.steps``): ``engine(batch)`` / ``engine.backward(loss)`` / ``engine.step()``
  over the gradient-accumulation micro-batches, or with pipeline parallelism the engine's
  ``train_batch``;
* **report** (``training.monitoring``): once per ``log_interval`` the pending steps come to the
  host in one read: ``metrics.jsonl``, DeepSpeed's monitors, the rank-0 progress line, the
  non-finite guard;
* **evaluate** every ``eval_interval`` steps, **save** every ``save_interval`` steps
  (``checkpointing.api.save``; our layout for Hugging Face export too with ``load_hf`` /
  ``export_hf_family``), **stop** at ``train_iters`` or earlier on a signal or schedule
  (``training.signals``), with a checkpoint;
* **finish**: ``loss_curve.png`` and the validation summary on rank 0, the groups destroyed.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..checkpointing import api as checkpoints
from ..checkpointing.run_dir import LATEST, check_resume, job_meta, tag_for
from ..config.job import JobConfig
from ..config.pipeline import pipeline_runtime, pipeline_schedule, virtual_pipeline_size
from ..convert.model_io import save_job_model
from ..models.gpt import MTP_LOSS
from ..models.gpt_chunks import GPTModelChunks
from ..utils.collectives import barrier
from . import liveness
from .build import TrainingSetup, build, build_data
from .metrics import METRICS, MetricsLog, plot_loss_curve, rewind_metrics, start_fresh_metrics
from .monitoring import NonFiniteGuard, PendingSteps, ProgressOutput, Reporter
from .signals import StopRequest
from .steps import MicroBatchStep, PipelineStep


@dataclass
class TrainResult:
    losses: Dict[int, float] = field(default_factory=dict)  # step -> DP-averaged train loss
    val_losses: Dict[int, float] = field(default_factory=dict)
    start_step: int = 0
    stop_reason: Optional[str] = None  # why the run ended before train_iters (a signal, exit_interval, ...)


@dataclass
class RunState:
    """Where the run is: the last finished step, the samples consumed, and the open log interval."""

    step: int
    consumed_samples: int
    interval_start: float = field(default_factory=time.perf_counter)
    interval_steps: int = 0
    records: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # host-side fields of unreported steps

    def restart_interval(self) -> None:
        """Tokens/s counts training steps only: the clock restarts after a report, an evaluation or a save."""
        self.interval_start, self.interval_steps = time.perf_counter(), 0


def aux_loss_names(config) -> List[str]:
    """The losses an MoE or multi-token-prediction model records beside the main one, in recording order."""
    routing = [name for name, coeff in (("z_loss", config.moe_z_loss_coeff),
                                        ("load_balancing_loss", config.moe_aux_loss_coeff))
               if coeff > 0 and config.num_experts]
    return routing + ([MTP_LOSS] if config.mtp_num_layers else [])


class Trainer:
    """One training job on an already launched set of ranks (see the module docstring)."""

    def __init__(self, job: JobConfig, config_source, resume: bool = False, show_progress: bool = True):
        self.job, self.tcfg, self.out_dir = job, job.train, job.train.output_dir
        resume_tag = check_resume(job, self.out_dir) if resume else None  # a mismatched checkpoint fails here, first
        setup: TrainingSetup = build(job, config_source)
        self.setup, self.engine, self.state = setup, setup.engine, setup.state
        self.rank = dist.get_rank()
        # The watchdog that ends the job when a peer's heartbeat stops; names the silent ranks if a collective fails
        # on a lost peer first (job.main, lost_peer_message).
        liveness.start(self.rank, dist.get_world_size(), self.tcfg.collective_timeout_minutes,
                       self.tcfg.heartbeat_timeout_seconds)
        self.say = print if self.rank == 0 and show_progress else (lambda *a, **k: None)
        for notice in job.megatron.notices:
            if notice not in self.engine.megatron.config.notices:  # the job's own (initialize logged the others)
                self.say(notice, flush=True)
        self.run = RunState(*self._resume(resume, resume_tag))
        self.data = build_data(job, setup, self.run.consumed_samples)
        self._announce(resume_tag)
        self.stepper = (PipelineStep(self.engine, setup.batches.micro_batches,
                                     isinstance(setup.model, GPTModelChunks)) if setup.pipeline else
                        MicroBatchStep(self.engine, setup.model, self.state, setup.batches.micro_batches))
        self.result = TrainResult(start_step=self.run.step)
        self.log = MetricsLog(os.path.join(self.out_dir, METRICS)) if self.rank == 0 else None
        self.progress = ProgressOutput(self.tcfg.train_iters, self.run.step, enabled=self.rank == 0 and show_progress)
        guard = NonFiniteGuard(self.tcfg.check_for_nan_in_loss_and_grad, self.tcfg.max_consecutive_nonfinite_steps,
                               loss_scaling=job.megatron.precision.uses_loss_scaling)
        self.reporter = Reporter(self.engine, self.log, self.progress, guard, self.tcfg.train_iters,
                                 setup.batches.global_batch * job.model.seq_length, self.engine.device)
        self.pending = PendingSteps(self.state.dp, self.state.pp if setup.pipeline else None)
        self.stop = StopRequest(self.tcfg, self.state.world, self.engine.device)
        self.show_progress = show_progress

    # -- build: where the run starts ---------------------------------------------------------------------------
    def _resume(self, resume: bool, resume_tag: Optional[str]):
        """``(step, consumed samples)`` to start from: the checkpoint's, or a fresh run's ``(0, 0)``."""
        step, consumed = 0, 0
        if resume_tag is not None:
            client = checkpoints.load(self.engine, self.out_dir, self.setup.rng_tracker)
            step, consumed = client["step"], client["consumed_train_samples"]
        elif resume:
            self.say(f"--resume: no checkpoint in {self.out_dir} (no {LATEST} file); starting at step 0", flush=True)
        if step > 0 and self.rank == 0:
            moved = rewind_metrics(self.out_dir, step)
            if moved:
                self.say(f"--resume at step {step}: {moved} {METRICS} records of later steps (trained again now) "
                         f"moved to {METRICS}.after-{step}", flush=True)
        if step == 0 and self.rank == 0:
            moved = start_fresh_metrics(self.out_dir)
            if moved:
                self.say(f"a new run starts in {self.out_dir}: the earlier {METRICS} is now {moved}", flush=True)
        return step, consumed

    def _announce(self, resume_tag: Optional[str]) -> None:
        """What the run is, one line each on rank 0: the layout and batch, the data, the checkpoint it resumed from."""
        job, layout, batches = self.job, self.state.layout, self.setup.batches
        dp = self.state.dp.size
        parts = [f"TP {layout.tp}" + (" with SP" if job.model.sequence_parallel and layout.tp > 1 else ""),
                 f"CP {layout.cp}", f"PP {layout.pp}", f"DP {dp}"]
        if job.model.num_experts:
            parts.append(f"experts EP {layout.ep} x ETP {layout.etp}")
        line = f"layout: {layout.world_size} ranks, " + " x ".join(parts)
        if layout.pp > 1:
            parallel = job.megatron.parallel
            v = virtual_pipeline_size(parallel, job.model.num_layers, layout.pp)
            where = ("DeepSpeed's PipelineEngine" if pipeline_runtime(parallel, job.megatron.optimizer_impl)
                     == "deepspeed" else "our runtime")
            line += f"; schedule {pipeline_schedule(parallel)}" + (f", {v} chunks per rank" if v > 1 else "") + \
                f" on {where}"
        self.say(f"{line}; global batch {batches.global_batch} = micro-batch {batches.micro_batch} x "
                 f"{batches.micro_batches} accumulation x DP {dp}, of {job.model.seq_length} tokens", flush=True)

        def describe(dataset):
            return getattr(dataset, "describe", lambda: f"{len(dataset):,} samples")()
        valid = "none" if self.data.valid is None else describe(self.data.valid)
        self.say(f"data: train {describe(self.data.train_set)}; validation {valid}", flush=True)
        if resume_tag is not None:
            self.say(f"resumed from {os.path.join(self.out_dir, resume_tag)}: step {self.run.step}, "
                     f"{self.run.consumed_samples:,} samples consumed", flush=True)

    # -- step ----------------------------------------------------------------------------------------------------
    def train_step(self, is_log_step: bool) -> Optional[float]:
        """One optimizer step; its loss stays on the device until the next report.  Returns the loop's own
        measure of the grad norm (a log step on DeepSpeed's plain fp32 path), else None."""
        engine, run, model = self.engine, self.run, self.setup.model
        skipped_before = engine.skipped_steps
        out = self.stepper.train(self.data.train, want_grad_norm=is_log_step)
        run.step += 1
        run.consumed_samples += self.setup.batches.global_batch
        run.interval_steps += 1
        moe_losses = {}
        if model.moe_aux_loss_tracker is not None:
            moe_losses = model.moe_aux_loss_tracker.averages()  # device tensors, no sync
            model.moe_aux_loss_tracker.reset()
            if self.setup.pipeline:  # the same names on every stage (a stage may hold no MoE layer), summed at flush
                zero = torch.zeros((), device=engine.device)
                moe_losses = {name: moe_losses.get(name, zero) for name in aux_loss_names(self.job.model)}
        self.pending.add(run.step, out.loss, moe_losses)
        run.records[run.step] = {"lr": engine.get_lr()[0], "consumed_samples": run.consumed_samples,
                                 "skipped": engine.skipped_steps != skipped_before}
        return out.grad_norm

    # -- report --------------------------------------------------------------------------------------------------
    def report(self, grad_norm: Optional[float]) -> None:
        """Bring the pending steps to the host and report them (the one sync per interval); the last one also
        with its grad norm (``grad_norm``, else the engine's), loss scale and skipped-step count."""
        engine, run = self.engine, self.run
        if grad_norm is None and engine.get_global_grad_norm() is not None:
            grad_norm = float(engine.get_global_grad_norm())
        run.records[run.step].update(grad_norm=grad_norm, loss_scale=getattr(engine.optimizer, "cur_scale", None),
                                     skipped_steps=engine.skipped_steps)
        rows = self.pending.flush()
        seconds = time.perf_counter() - run.interval_start
        for step, loss_value, _ in rows:
            self.result.losses[step] = loss_value
        try:
            self.reporter.report(rows, run.records, seconds, run.interval_steps)
        finally:
            run.restart_interval()

    # -- evaluate --------------------------------------------------------------------------------------------------
    def evaluate(self) -> None:
        """The validation loss at the current step (the mean over the validation set and data parallelism)."""
        val = self.stepper.evaluate(self.data.validation_batches())
        self.result.val_losses[self.run.step] = val
        self.reporter.report_validation(self.run.step, val, self.run.consumed_samples)

    # -- save ------------------------------------------------------------------------------------------------------
    def save(self) -> None:
        """A checkpoint of the current step (and, for Hugging Face export, the model in our layout beside it)."""
        step, tcfg = self.run.step, self.tcfg
        checkpoints.save(self.engine, self.out_dir, step,
                         {"step": step, "consumed_train_samples": self.run.consumed_samples},
                         ckpt_format=tcfg.ckpt_format, rng_tracker=self.setup.rng_tracker,
                         job_meta=job_meta(self.job), keep_last_n=tcfg.keep_last_n_checkpoints)
        if tcfg.load_hf or tcfg.export_hf_family:  # our layout too, for `ds-megatron convert` to HF
            save_job_model(self.setup.model, self.job, self.state, os.path.join(self.out_dir, tag_for(step)))
        self.say(f"saved {os.path.join(self.out_dir, tag_for(step))} (step {step})", flush=True)

    # -- the loop --------------------------------------------------------------------------------------------------
    def run_loop(self, stop_after: Optional[int] = None) -> TrainResult:
        """Steps until ``train_iters`` (or ``stop_after``, or a stop request); every rank takes the same branches."""
        tcfg, run = self.tcfg, self.run
        validating = self.data.valid is not None
        self.stop.start()
        try:
            if validating and run.step == 0:
                self.evaluate()  # the starting point of the validation curve
            start = run.step
            while run.step < tcfg.train_iters:
                is_log_step = (run.step + 1) % tcfg.log_interval == 0 or run.step == start
                grad_norm = self.train_step(is_log_step)
                stop_reason = self.stop.check(run.step)  # the same on every rank
                done = run.step == tcfg.train_iters or run.step == stop_after or stop_reason is not None
                evaluating = validating and (run.step % tcfg.eval_interval == 0 or run.step == tcfg.train_iters)
                saving = bool(tcfg.save_interval and run.step % tcfg.save_interval == 0) or done
                if is_log_step or done or evaluating or saving:
                    self.report(grad_norm)
                if evaluating:
                    self.evaluate()
                if saving:
                    self.save()
                if evaluating or saving:
                    run.restart_interval()
                if stop_reason is not None:
                    self.result.stop_reason = stop_reason
                    self.progress.message(f"stopping after step {run.step} ({stop_reason}): checkpoint "
                                          f"{tag_for(run.step)} saved; continue with --resume")
                    break
                if run.step == stop_after:
                    break
        finally:
            self.stop.close()
            self.progress.close()
        return self.result

    # -- finish ----------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Rank 0: the loss curve and the validation summary of a run that reached ``train_iters``; then the
        engine's groups go."""
        if self.rank == 0 and self.run.step == self.tcfg.train_iters and self.show_progress:
            curve = os.path.join(self.out_dir, "loss_curve.png")
            why_not = plot_loss_curve(self.log.read(), curve)
            print(why_not or f"loss curve: {curve}", flush=True)
            vals = {r["step"]: r["val_loss"] for r in self.log.read() if r.get("val_loss") is not None}
            if len(vals) > 1:
                first, last = min(vals), max(vals)
                print(f"validation loss: {vals[first]:.4f} at step {first} -> {vals[last]:.4f} at step {last}",
                      flush=True)
        liveness.stop()
        self.engine.megatron.destroy()


def train(job: JobConfig, config_source, resume: bool = False, stop_after: Optional[int] = None,
          show_progress: bool = True) -> TrainResult:
    """Run the job on an already launched set of ranks; returns the losses it saw.

    ``stop_after``: end after this step (simulates an interruption; tests use it).  A non-finite
    loss raises ``NonFiniteLossError`` (``monitoring.NonFiniteGuard``); a signal, ``exit_interval`` or
    ``exit_duration_in_mins`` ends the run early with a checkpoint (``signals.StopRequest``).
    """
    trainer = Trainer(job, config_source, resume, show_progress)
    result = trainer.run_loop(stop_after)
    trainer.finish()
    return result


def shutdown(exit_code: int = 0) -> None:
    """Leave the job cleanly: barrier, destroy the default group, then skip interpreter teardown.

    Interpreter teardown under gloo sometimes aborts ("terminate called without
    an active exception"), which a launcher would report as a failed run.
    """
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# How gloo and NCCL word a collective that failed because a peer went away or never answered.
_LOST_PEER_MARKERS = ("Timed out waiting", "Connection reset by peer", "Connection closed by peer",
                      "Connection refused", "Broken pipe", "Socket Timeout", "collective operation timeout",
                      "Watchdog caught", "NCCL communicator was aborted")


def is_lost_peer(error: BaseException) -> bool:
    """A collective failed because a peer went away or never answered (gloo's and NCCL's words for it)."""
    return any(marker in str(error) for marker in _LOST_PEER_MARKERS)


def lost_peer_message(error: BaseException, timeout_minutes: float, silent: str = "") -> Optional[str]:
    """One line for a collective that failed on a lost or silent peer (None for any other error): this rank, its
    host, the timeout, the backend's words (gloo names the peer's address when the connection broke) and
    ``silent``, the ranks whose heartbeat stopped (``liveness.describe_silent``)."""
    if not is_lost_peer(error):
        return None
    text = str(error)
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    detail = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (f"ds-megatron train: error: rank {rank} on {socket.gethostname()}: a collective failed: a peer rank was "
            f"lost (its node down or cut off) or stalled, or did not answer within "
            f"megatron.train.collective_timeout_minutes={timeout_minutes:g}: {detail}{silent}; the checkpoint "
            "'latest' names is complete: restart with --resume")
