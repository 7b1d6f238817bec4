"""Loaded by the SGLang engine's Python at start-up (this directory is on its PYTHONPATH).

SGLang's LoRA code pins host memory unconditionally (`Tensor.pin_memory()`, and `pin_memory=True`
to tensor factories), which needs an NVIDIA driver. On a CPU-only machine pinning is meaningless,
so here it does nothing: `Tensor.pin_memory` returns the tensor, and the factories drop the flag.
"""

import functools

try:
    import torch
except ImportError:  # another interpreter picked this directory up: nothing to patch
    torch = None


def _without_pinning(factory):
    @functools.wraps(factory)
    def create(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return create


if torch is not None:
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like"):
        setattr(torch, _name, _without_pinning(getattr(torch, _name)))
