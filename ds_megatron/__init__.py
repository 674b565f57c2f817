"""ds_megatron: Megatron-LM's parallel machinery inside DeepSpeed's engine."""
__version__ = "0.1.0"
