"""Loaded by the SGLang engine's Python at start-up (this directory is on its PYTHONPATH).

SGLang's LoRA code pins host memory unconditionally (`Tensor.pin_memory()`, and `pin_memory=True`
to tensor factories), which needs an NVIDIA driver. On a CPU-only machine pinning is meaningless,
so here it does nothing: `Tensor.pin_memory` returns the tensor, and the factories drop the flag.

SGLang's Mooncake KV sender (prefill/decode disaggregation) records a CUDA event after copying a
chunk's page indices to the host, and its transfer thread waits on it. On a CPU the copy has
already happened when the call returns, so without a GPU `torch.cuda.Event` is an event that is
always complete and `torch.cuda.current_stream()` a stream with nothing pending.
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


class _DoneEvent:
    """A CUDA event on a machine without CUDA: CPU work is synchronous, so it is always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, stream=None):
        pass


class _IdleStream:
    def synchronize(self):
        pass

    def wait_event(self, event):
        pass

    def query(self):
        return True


if torch is not None and not torch.cuda.is_available():
    torch.cuda.Event = _DoneEvent
    torch.cuda.current_stream = lambda device=None: _IdleStream()
