"""``ds-megatron train``: the command line of a training job (torch-free until the config is valid).

``main`` parses the job's config (``config.job.load_job``) against the world size the launcher
announced and, with ``--resume``, checks the checkpoint against it; a bad config is reported in
one line (by the first rank of each node) with exit code 2, before torch or DeepSpeed is imported.
Only then does it load the training loop (``training.train``).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional, Sequence

from ..checkpointing.run_dir import check_resume
from ..config.job import load_job
from ..config.parsing import SECTION, local_rank_from_env, world_size_from_env
from ..errors import ConfigError, NonFiniteLossError


# How long a rank that does not print a config error outlives the one that does (it parses the same config).
QUIET_RANK_EXIT_DELAY_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-megatron train", description="train a GPT from a DeepSpeed JSON config "
                                                                      f"with a \"{SECTION}\" section")
    p.add_argument("--config", required=True, help=f"DeepSpeed JSON config with a \"{SECTION}\" section")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output dir")
    p.add_argument("--output-dir", help="where checkpoints, metrics.jsonl and loss_curve.png go "
                                        f"(default: {SECTION}.train.output_dir)")
    p.add_argument("--train-iters", type=int, help=f"override {SECTION}.train.train_iters")
    p.add_argument("--load-hf", help=f"start from this Hugging Face checkpoint (sets {SECTION}.train.load_hf)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit codes: 0 trained (or stopped gracefully, checkpoint saved), 2 bad config or a checkpoint that does
    not fit it, 3 the loss stayed non-finite (``megatron.train.check_for_nan_in_loss_and_grad``), 4 a collective
    failed: a peer rank was lost or did not answer within ``megatron.train.collective_timeout_minutes``."""
    args, _ = build_parser().parse_known_args(argv)
    try:
        job = load_job(args.config, world_size_from_env() or 1, args.train_iters, args.output_dir, args.load_hf)
        if args.resume:
            check_resume(job, job.train.output_dir)
    except ConfigError as e:
        # Every rank of a node reads the same files and fails alike: its first rank says why, once per node (another
        # node may lack a file this one has).  The others wait before leaving, so that a launcher, which stops every
        # rank when the first one exits, does not stop the speaker before its line is out.
        if local_rank_from_env() == 0:
            print(f"ds-megatron train: error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return 2
    # Boundary: the config is valid, only now load torch, DeepSpeed and the loop.
    from . import train as loop
    from .signals import keep_running_without_output  # with the loop (torch), past the same boundary
    keep_running_without_output()  # a launcher's lost ssh session must not kill a rank mid-save
    try:
        loop.train(job, args.config, resume=args.resume)
    except NonFiniteLossError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"ds-megatron train: error: {e}", file=sys.stderr, flush=True)
        loop.shutdown(e.exit_code)
    except RuntimeError as e:  # a peer lost mid-collective (node down or cut off, a rank stalled): no barrier now
        if not loop.is_lost_peer(e):
            raise
        # DeepSpeed's launch.py SIGTERMs a failed rank's siblings: let this one finish its line first (bounded).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from . import liveness  # loaded with the loop above; imported here where it is used
        # Which ranks went silent (a few heartbeats' wait), then leave marked so the other survivors do not name us.
        line = loop.lost_peer_message(e, job.train.collective_timeout_minutes, liveness.describe_silent())
        beat = liveness.current()
        # (unless the watchdog found the loss first and is printing its own line)
        liveness.leave_process(line, beat.leave if beat is not None else None)
    loop.shutdown()
    return 0
