"""Checkpoints in other shapes: ``export_fp32`` consolidates a training checkpoint into one fp32 state dict."""
