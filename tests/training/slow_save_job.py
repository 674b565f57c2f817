"""`ds-megatron train` whose save of checkpoint $BLOCK_TAG stops half way on rank 0 (test_stop_and_kill.py).

DeepSpeed's format: rank 0 writes the first bytes of DeepSpeed's model-states file for that tag.
torch_dist: every rank has written its data files and rank 0, the coordinator, stops before the
metadata file.  Either way it then creates $BLOCK_MARKER and waits forever: the test kills the
whole job, as a lost node would, mid-save.
"""
import os
import sys
import time

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import ds_megatron.checkpointing.deepspeed_format as deepspeed_format
from ds_megatron.training.job import main

real_save = deepspeed_format.save_checkpoint


def save_checkpoint(engine, save_dir, tag=None, **kwargs):
    if tag == os.environ["BLOCK_TAG"] and dist.get_rank() == 0:
        def partial_write(state_dict, path):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a checkpoint")
            open(os.environ["BLOCK_MARKER"], "w").close()
            while True:
                time.sleep(1)
        engine.checkpoint_engine.save = partial_write
    return real_save(engine, save_dir, tag=tag, **kwargs)


def block_forever():
    open(os.environ["BLOCK_MARKER"], "w").close()
    while True:
        time.sleep(1)


real_finish = FileSystemWriter.finish


def finish(self, metadata, results):
    if os.path.basename(os.path.normpath(str(self.path))) == os.environ["BLOCK_TAG"]:
        block_forever()
    return real_finish(self, metadata, results)


deepspeed_format.save_checkpoint = save_checkpoint
FileSystemWriter.finish = finish
sys.exit(main(sys.argv[1:]))
