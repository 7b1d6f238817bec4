"""Where a simulated engine keeps its LoRA adapters, and what moving them costs: SGLang 0.5.23's
two bands, pure (the scheduler owns the clock).

- **Loaded** (host memory; SGLang's `LoRARegistry`): every adapter `/load_lora_adapter` loaded,
  in least-recently-used order. A request for an adapter moves it to the end (SGLang's
  `acquire`). With `--max-loaded-loras N`, a load that makes N + 1 unloads the least recently
  used unpinned adapter (the tokenizer manager's `lru_lora_name(exclude_pinned=True)`; the one
  just loaded is last, so it goes only when all others are pinned), and the load's answer lists
  what is left. Requests already holding the evicted adapter finish with it (SGLang waits for
  them before it frees the weights); a later request for it loads it again implicitly.
- **On the GPU** (SGLang's `LoRAMemoryPool`): `--max-loras-per-batch` slots, the base model
  taking one when a batch has base requests. A batch that needs an adapter not in a slot takes
  an empty slot, else evicts by `--lora-eviction-policy` (`lru`, the default, or `fifo`) among
  slots the batch does not use and not pinned, an adapter before the base model
  (`prepare_lora_batch`). The copy blocks the step that needs it.

Load times come from the adapter's size: its rank (`adapter_config.json` of a local directory,
else the rank the timing model prices) on the seven projections of every layer of the modelled
70B model, BF16 (`inferbus.timing.lora_adapter_bytes`: 414 MB at rank 16). From disk into host memory
at `DISK_BANDWIDTH` plus a fixed cost for opening and registering it, inside SGLang's scheduler
loop (`Scheduler.load_lora_adapter`), so no batch runs meanwhile (the scheduler's `loading_until`). From host memory
into a GPU slot as SGLang 0.5.23 copies it (`LoRAMemoryPool.load_lora_weight_to_buffer`): no file read, one
`copy_(non_blocking=True)` per A and B of each of a layer's four LoRA modules, from pinned memory at
the PCIe rate of `inferbus.timing.LORA_LOAD_BANDWIDTH`. Without `--enable-lora-overlap-loading` every
copy pins its weights first (`weight.pin_memory()`: a host memory copy); with it the pinned copy is
kept with the adapter (`_get_maybe_cached_weight_for_transfer`), so only its first copy pins.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from inferbus.timing import GB, LLAMA_70B, LORA_LOAD_BANDWIDTH, LORA_MODULES_PER_LAYER, lora_adapter_bytes

# Reading safetensors from a local NVMe drive and turning them into tensors in host memory:
# ~2 GB/s end to end (assumption: PCIe Gen4 NVMe reads ~7 GB/s, deserialising and the CPU copy
# halve it twice), plus 100 ms to open the directory, parse its config and register the adapter.
DISK_BANDWIDTH = 2 * GB
DISK_FIXED_S = 0.1
# Issuing one tensor copy to the GPU, and pinning host memory (a host memory copy into a fresh
# page-locked buffer): assumptions, ~5 µs and ~10 GB/s.
COPY_ISSUE_S = 5e-6
PIN_BANDWIDTH = 10 * GB
EVICTION_POLICIES = ("lru", "fifo")


def adapter_rank(path: str, default: int) -> int:
    """The rank a local PEFT directory declares; `default` for anything else."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        return max(1, int(config.get("r", default)))
    except (OSError, ValueError, TypeError):
        return default


def disk_load_s(rank: int) -> float:
    """Seconds from disk into host memory (`/load_lora_adapter`, or an implicit reload)."""
    return DISK_FIXED_S + lora_adapter_bytes(rank) / DISK_BANDWIDTH


def host_to_gpu_s(rank: int, pinned: bool) -> float:
    """Seconds from host memory into a GPU slot; `pinned`: the weights are in pinned memory already."""
    size = lora_adapter_bytes(rank)
    tensors = LLAMA_70B.layers * LORA_MODULES_PER_LAYER * 2
    pin = 0.0 if pinned else size / PIN_BANDWIDTH
    return tensors * COPY_ISSUE_S + pin + size / LORA_LOAD_BANDWIDTH


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    pinned: bool
    ready_at: float  # when its weights are in host memory
    broken: bool = False  # accepted without a check (lazy loading) but its weights do not exist
    rank: int = 16
    host_pinned: bool = False  # a pinned copy kept for overlap loading's transfers


class LoadedAdapters:
    """SGLang's registry of loaded adapters: least recently used first, bounded by `cap`."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._order: OrderedDict[str, LoraAdapter] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, name: str) -> LoraAdapter:
        return self._order[name]

    def get(self, name: str) -> LoraAdapter | None:
        return self._order.get(name)

    def items(self) -> list[tuple[str, LoraAdapter]]:
        return list(self._order.items())

    def touch(self, name: str) -> None:
        """A request uses it: most recently used now."""
        if name in self._order:
            self._order.move_to_end(name)

    def add(self, adapter: LoraAdapter) -> list[str]:
        """Register a loaded adapter; the names unloaded to stay within the cap, oldest first."""
        self._order[adapter.name] = adapter
        evicted: list[str] = []
        while self.cap is not None and len(self._order) > self.cap:
            victim = next((name for name, a in self._order.items() if not a.pinned), None)
            if victim is None:
                break  # everything is pinned: SGLang refuses such a load before it gets here
            del self._order[victim]
            evicted.append(victim)
        return evicted

    def remove(self, name: str) -> LoraAdapter | None:
        return self._order.pop(name, None)


class GpuSlots:
    """SGLang's LoRA memory pool: which adapters (None: the base model) hold a GPU slot."""

    def __init__(self, slots: int, policy: str = "lru") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"lora eviction policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.slots = slots
        self.policy = policy
        self._resident: OrderedDict[str | None, None] = OrderedDict()  # eviction order: first goes first
        self.loads = 0
        self.evictions = 0

    @property
    def resident(self) -> set[str | None]:
        return set(self._resident)

    def prepare(self, batch: set[str | None], pinned: set[str]) -> list[str | None]:
        """Give every adapter of the batch a slot; returns the ones copied in now (the step pays
        for them). The batch never needs more slots than there are (the scheduler admits at most
        that many distinct adapters)."""
        copied: list[str | None] = []
        for uid in sorted(batch, key=lambda u: (u is not None, u or "")):  # SGLang's deterministic order
            if uid in self._resident:
                continue
            if len(self._resident) >= self.slots:
                candidates = [u for u in self._resident if u not in batch and (u is None or u not in pinned)]
                if not candidates:
                    raise ValueError("No available buffer slots found. Please ensure the number of active "
                                     "(pinned) loras is less than max_loras_per_batch.")
                adapters = [u for u in candidates if u is not None]
                victim = (adapters or candidates)[0]  # first in eviction order
                del self._resident[victim]
                self.evictions += 1
            self._resident[uid] = None
            self.loads += 1
            copied.append(uid)
        if self.policy == "lru":
            for uid in sorted(batch, key=lambda u: (u is not None, u or "")):
                self._resident.move_to_end(uid)
        return copied

    def drop(self, name: str) -> None:
        """An unloaded adapter frees its slot."""
        self._resident.pop(name, None)


def lora_path_exists(path: str) -> bool:
    """The simulator's stand-in for a file check: paths starting with "missing" or "bad" fail."""
    return bool(path) and not path.startswith(("missing", "bad"))
