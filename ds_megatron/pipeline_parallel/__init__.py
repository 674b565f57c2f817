"""Megatron's pipeline schedules run by ds_megatron itself: the schedule table, the stage-to-stage channels, the
runtime.  Import the modules (``schedule_table`` is torch-free; ``p2p_communication`` and ``schedules`` need torch)."""
