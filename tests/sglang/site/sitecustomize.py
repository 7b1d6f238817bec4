"""Loaded by the SGLang engine's Python at start-up (this directory is on its PYTHONPATH).

SGLang's LoRA memory pool pins host memory unconditionally, which needs an NVIDIA driver; on a
CPU-only machine pinning is meaningless, so `Tensor.pin_memory` returns the tensor unchanged.
"""

try:
    import torch
except ImportError:  # another interpreter picked this directory up: nothing to patch
    pass
else:
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
