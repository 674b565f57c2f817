"""The training job behind ``ds-megatron train``: config sections, LR schedule, checkpoints, metrics, loop."""
