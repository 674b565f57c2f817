"""Every part of DeepSpeed we rely on beyond its public API is where we rely on it, in the installed DeepSpeed.

``integration.seams`` is the one module that touches DeepSpeed's internals; ``check_seams`` holds each
one to the installed DeepSpeed without building an engine, so an upgrade that moves one fails here
with one line naming it.  The other tests show the checks can fail, that no private DeepSpeed name is
used elsewhere in the package, and that the one module function we wrap keeps no state of ours.
"""
import os
import re
import warnings

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import PipelineModule, p2p
from deepspeed.utils import groups

from ds_megatron.integration import seams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DeepSpeed names and engine state we read or write beyond its public API, as they are spelled in code; only
# seams.py may spell them (integration/pipeline.py overrides two PipelineModule methods by name, which seams checks).
PRIVATE = [r"\._config\b", r"\b_EXPERT_(DATA_)?PARALLEL_GROUP", r"\._get_expert\w*", r"\._create_expert\w*", r"_CUDA_RNG_STATE_TRACKER",
           r"__compatible_ops__", r"\._local_start\b", r"\._recursive_getattr\b", r"\._set_bounds\b", r"\._grid\b",
           r"\.tied_comms\b", r"\.tied_modules\b", r"\.forward_funcs\b", r"enable_backward_allreduce",
           r"\.inside_no_sync_ctxt\b", r"\.clip_fp32_gradients\b", r"\.has_moe_layers\b", r"engine\.num_experts\b",
           r"engine\.expert(_data)?_parallel_group\b", r"engine\.micro_batches\b", r"\bp2p\.", r"\.world_group\b",
           r"engine\.(global_steps|global_samples|skipped_steps)\s*=[^=]", r"\bgroups\.mpu\b",
           r"\._load_zero_checkpoint\b"]


def test_deepspeed_has_every_seam_we_rely_on():
    problems = seams.check_seams()
    assert not problems, "DeepSpeed " + deepspeed.__version__ + " moved what ds_megatron relies on:\n" + \
        "\n".join(problems)


def test_every_seam_names_its_accessor():
    for seam in seams.SEAMS:
        assert seam.what and seam.used_by and callable(seam.check)


@pytest.mark.parametrize("break_it, names", [
    (lambda mp: mp.delattr(groups, "_EXPERT_DATA_PARALLEL_GROUP"), "_EXPERT_DATA_PARALLEL_GROUP"),
    (lambda mp: mp.setattr(DeepSpeedEngine, "_get_expert_ckpt_name",
                           staticmethod(lambda path, layer, expert, tag, mpu=None, checkpoint_mp_rank=None:
                                        os.path.join(path, tag, f"expert_{expert}.pt"))), "_get_expert_ckpt_name"),
    (lambda mp: mp.setattr(p2p, "send", lambda tensor, dest: None), "async_op"),
    (lambda mp: mp.setattr(PipelineModule, "_partition_layers", lambda self: None), "_partition_layers"),
    (lambda mp: mp.delattr(DeepSpeedEngine, "clip_fp32_gradients"), "clip_fp32_gradients"),
    (lambda mp: mp.delattr(DeepSpeedEngine, "_load_zero_checkpoint"), "_load_zero_checkpoint"),
], ids=["expert-table", "expert-file-name", "p2p-send", "partition-override", "clip-method", "bf16-optimizer-load"])
def test_a_moved_seam_is_reported_by_name(monkeypatch, break_it, names):
    break_it(monkeypatch)
    problems = seams.check_seams()
    assert len(problems) == 1 and names in problems[0], problems


def test_no_private_deepspeed_name_outside_the_seams_module():
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "ds_megatron")):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.endswith(".py") or path.endswith(os.path.join("integration", "seams.py")):
                continue
            for number, line in enumerate(open(path), 1):
                code = line.split("#")[0]
                code = re.sub(r"(\"\"\"|''').*|\"[^\"]*\"|'[^']*'|``[^`]*``", "", code)  # strings and doc spans
                for private in PRIVATE:
                    if re.search(private, code):
                        found.append(f"{os.path.relpath(path, ROOT)}:{number}: {private}: {line.strip()}")
    assert not found, "reach DeepSpeed's internals through ds_megatron.integration.seams:\n" + "\n".join(found)


def test_the_send_wrapper_keeps_its_state_in_itself():
    original = p2p.send
    seen = []
    undo_first = seams.count_pipeline_sends(seen.append)
    first = p2p.send
    undo_second = seams.count_pipeline_sends(lambda t: seen.append(("second", t)))
    try:
        assert first is not original and first.__wrapped__ is original
        assert p2p.send.__wrapped__ is original, "a second install wraps DeepSpeed's function, not the first wrapper"
        undo_first()  # no longer installed: leaves the second alone
        assert p2p.send is not original
    finally:
        undo_second()
    assert p2p.send is original


def test_the_version_check():
    with pytest.raises(ImportError, match="DeepSpeed >= 0.16"):
        seams.check_deepspeed_version("0.15.4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seams.check_deepspeed_version("0.20.0")
        seams.check_deepspeed_version("0.19.8+cpu")
    assert len(caught) == 1 and "0.20.0" in str(caught[0].message)
