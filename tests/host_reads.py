"""What reads device data from the host (or copies host data to the device): a stall per call on a GPU, and illegal
inside a CUDA graph capture.  On a CPU nothing stalls, so tests catch the calls themselves: ``Tensor`` methods and
``torch`` functions by name (``repeat_interleave`` only with tensor repeats and no output size)."""

TENSOR_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "nonzero")
TORCH_FUNCTIONS = ("nonzero", "unique", "masked_select", "tensor", "as_tensor")
