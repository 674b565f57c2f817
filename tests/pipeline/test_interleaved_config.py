"""What the interleaved and zero-bubble schedules (our pipeline runtime) refuse at start, in one line naming the field."""
import pytest

from ds_megatron.config import ConfigError
from ds_megatron import validate_config as validate

MODEL = dict(num_layers=8, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=60)


def _cfg(gas=4, **megatron):
    section = {"pipeline_model_parallel_size": 2, "model": dict(MODEL)}
    section.update(megatron)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "megatron": section}


@pytest.mark.parametrize("megatron,gas,field", [
    (dict(virtual_pipeline_model_parallel_size=2), 3, "microbatch_group_size_per_vp_stage"),
    (dict(virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=4), 6,
     "microbatch_group_size_per_vp_stage"),
    (dict(virtual_pipeline_model_parallel_size=3), 4, "virtual_pipeline_model_parallel_size=3"),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_schedule="1f1b"), 4, "pipeline_schedule"),
    (dict(pipeline_schedule="zero_bubble", virtual_pipeline_model_parallel_size=2), 4, "zero_bubble"),
    (dict(pipeline_schedule="zero_bubble", optimizer_impl="deepspeed"), 4, "optimizer_impl"),
    (dict(pipeline_schedule="gpipe"), 4, "pipeline_schedule"),
    (dict(virtual_pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2), 4,
     "num_layers_per_virtual_pipeline_stage"),
    (dict(num_layers_per_virtual_pipeline_stage=3), 4, "num_layers_per_virtual_pipeline_stage"),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_partition_method="parameters"), 4,
     "pipeline_partition_method"),
    (dict(virtual_pipeline_model_parallel_size=2, optimizer_impl="deepspeed"), 4, "optimizer_impl"),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_num_layers_per_stage=[4, 4]), 4,
     "pipeline_num_layers_per_stage"),
    (dict(decoder_first_pipeline_num_layers=9), 4, "decoder_first_pipeline_num_layers"),
    (dict(decoder_first_pipeline_num_layers=8), 4, "decoder_first/last_pipeline_num_layers"),
    (dict(virtual_pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=3), 4,
     "decoder_first/last_pipeline_num_layers"),
    (dict(decoder_first_pipeline_num_layers=2, pipeline_num_layers_per_stage=[2, 6]), 4,
     "pipeline_num_layers_per_stage"),
    (dict(pipeline_schedule="zero_bubble", cuda_graph={"impl": "local"}), 4, "cuda_graph"),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=1), 4,
     "virtual_pipeline_model_parallel_size"),
])
def test_refused_in_one_line(megatron, gas, field):
    with pytest.raises(ConfigError) as info:
        validate(_cfg(gas, **megatron), world_size=2)
    message = str(info.value)
    assert field in message and "\n" not in message, message


@pytest.mark.parametrize("megatron,gas", [
    (dict(virtual_pipeline_model_parallel_size=2), 4),
    (dict(num_layers_per_virtual_pipeline_stage=2), 2),
    (dict(virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=3), 6),
    (dict(pipeline_schedule="interleaved_1f1b"), 3),
    (dict(pipeline_schedule="zero_bubble"), 3),
    (dict(virtual_pipeline_model_parallel_size=2, pipeline_num_layers_per_stage=[1, 3, 3, 1]), 4),
    (dict(virtual_pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2), 4),
    (dict(virtual_pipeline_model_parallel_size=2, cuda_graph={"impl": "local"}), 4),
])
def test_accepted(megatron, gas):
    validate(_cfg(gas, **megatron), world_size=2)


@pytest.mark.parametrize("megatron,runtime", [
    (dict(), "ds_megatron"),  # "1f1b" on our optimizer path: our runtime, one chunk
    (dict(optimizer_impl="deepspeed"), "deepspeed"),  # DeepSpeed's reduction and ZeRO: DeepSpeed's PipelineEngine
    (dict(virtual_pipeline_model_parallel_size=2), "ds_megatron"),
    (dict(pipeline_schedule="zero_bubble"), "ds_megatron"),
])
def test_which_runtime_train_builds(megatron, runtime):
    import ds_megatron
    from ds_megatron.config.pipeline import pipeline_runtime
    from ds_megatron.models.gpt_chunks import GPTModelChunks
    _, mcfg = validate(_cfg(4, **megatron), world_size=2)
    assert pipeline_runtime(mcfg.parallel, mcfg.optimizer_impl) == runtime
    assert ds_megatron.GPTModelChunks is GPTModelChunks  # the public name the docs build it by
