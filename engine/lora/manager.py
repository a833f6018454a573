"""Which adapters the engine serves, which are in host memory, and which sit in the runner's --max-loras slots.

- Registered adapters: name -> LoRARequest. An id is never reused in an engine's life (the prefix cache and the
  KV events key blocks by it, so a name re-added with other weights never meets the old blocks).
- Host copies: the runner's loaded form of an adapter (LoRA weights; the sim backend's config), kept for up to
  --max-cpu-loras adapters, least recently used first out; adding an adapter loads it once, which is its check.
- Slots: the adapters a batch can use. The scheduler asks `make_resident` when it admits a request; an adapter
  with running requests keeps its slot (`busy`), the least recently used other one gives its slot up, and when
  none can, the request waits while others go ahead (vLLM's rule).
- Removal: the name goes at once (new requests for it are refused); requests already queued or running keep their
  adapter until they end (`drop_retired`, called by the scheduler while any removed adapter is still in use).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvgate.common.errors import LoRAError
from kvgate.engine.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, max_loras: int, max_cpu_loras: int | None, load: Callable[[LoRARequest], object],
                 set_slot: Callable[[int, object | None], None]) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._load = load
        self._set_slot = set_slot
        self.registered: dict[str, LoRARequest] = {}
        self.retired: dict[int, LoRARequest] = {}  # removed, with requests still using them
        self._ids_used: set[int] = set()
        self._host: OrderedDict[int, object] = OrderedDict()
        self.slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # slot indices, least recently used first

    # -- registry ---------------------------------------------------------------------------------

    def add(self, lora: LoRARequest) -> None:
        if lora.lora_name in self.registered:
            raise LoRAError(f"a LoRA adapter named {lora.lora_name!r} is already loaded")
        if lora.lora_int_id in self._ids_used:
            raise LoRAError(f"LoRA id {lora.lora_int_id} was already used in this engine")
        self._cache(lora.lora_int_id, self._load(lora))  # raises LoRAError for an adapter the runner cannot serve
        self._ids_used.add(lora.lora_int_id)
        self.registered[lora.lora_name] = lora

    def remove(self, name: str, in_use: set[int]) -> bool:
        """Unregister `name`; its slot and host copy go now, or once no request in `in_use` (adapter ids of
        unfinished requests) needs it. False when no adapter has that name."""
        lora = self.registered.pop(name, None)
        if lora is None:
            return False
        self.retired[lora.lora_int_id] = lora
        self.drop_retired(in_use)
        return True

    def get(self, name: str) -> LoRARequest | None:
        return self.registered.get(name)

    def list(self) -> list[LoRARequest]:
        return sorted(self.registered.values(), key=lambda lora: lora.lora_int_id)

    def drop_retired(self, in_use: set[int]) -> None:
        for lora_id in [i for i in self.retired if i not in in_use]:
            del self.retired[lora_id]
            self._host.pop(lora_id, None)
            if lora_id in self.slots:
                slot = self.slots.index(lora_id)
                self.slots[slot] = None
                self._set_slot(slot, None)

    # -- residency --------------------------------------------------------------------------------

    def slot_of(self, lora_id: int) -> int | None:
        return self.slots.index(lora_id) if lora_id in self.slots else None

    def make_resident(self, lora: LoRARequest, busy: set[int]) -> int | None:
        """The slot holding `lora`, loading it into a free slot or one whose adapter is not in `busy` (ids with
        running requests); None when every slot is busy with another adapter."""
        slot = self.slot_of(lora.lora_int_id)
        if slot is None:
            free = [s for s in range(self.max_loras) if self.slots[s] is None]
            if not free:
                free = [s for s in self._slot_lru if self.slots[s] not in busy]
            if not free:
                return None
            slot = free[0]
            self._set_slot(slot, self._host_copy(lora))
            self.slots[slot] = lora.lora_int_id
        self._slot_lru.pop(slot, None)
        self._slot_lru[slot] = None
        return slot

    def _host_copy(self, lora: LoRARequest) -> object:
        if lora.lora_int_id in self._host:
            self._host.move_to_end(lora.lora_int_id)
            return self._host[lora.lora_int_id]
        loaded = self._load(lora)  # evicted from host memory since it was added: read it again
        self._cache(lora.lora_int_id, loaded)
        return loaded

    def _cache(self, lora_id: int, loaded: object) -> None:
        self._host[lora_id] = loaded
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
