"""The worker's LoRA adapters: which are read into host memory, which sit in the layers'
slots, and which rows of a step use which slot.

Every LoRA-capable linear layer of the model gets `max_loras` slots (layers/lora.py). An
adapter a step needs is read from its folder the first time (`read_adapter`, this rank's
slices), kept in host memory (the `max_cpu_loras` most recently used), and written into a
free slot, or the slot of the adapter used longest ago that this step does not need. The
scheduler never puts more than `max_loras` adapters in one step, so one is always free.

Every rank makes the same choices from the same step messages, so the slots agree.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from serve.lora_request import LoRARequest
from serve.models.layers.lora import LoRABatch, LoRASlots
from serve.models.lora import Adapter, is_lora_layer, read_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        param = next(model.parameters())
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if is_lora_layer(module):
                in_features = module.num_local_inputs
                slots = LoRASlots(
                    module.lora_shards(),
                    in_features,
                    max_loras,
                    max_rank,
                    param.dtype,
                    param.device,
                )
                module.lora = slots
                self.layers[name] = slots
        if not self.layers:
            raise ValueError(
                f"{type(model).__name__} has no layers that take LoRA adapters (serve's "
                "linear layers); --enable-lora needs one of the natively built families."
            )
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self._slot_use: list[int] = [0] * max_loras  # the step each slot was last used in
        self._host: OrderedDict[int, Adapter] = OrderedDict()  # most recently used last
        self._step = 0

    def batch(
        self, loras: list[LoRARequest | None], query_lens: list[int]
    ) -> tuple[LoRABatch | None, dict[int, str]]:
        """The step's LoRABatch for its sequences in token-stream order (their adapters and
        query lengths), their adapters placed in slots first (None: no token has one), and
        the adapters that could not be read, by id, with why: an adapter checked before
        its first use can still fail here when it is read again from its folder (pushed
        out of host memory, its folder deleted since). Their rows run without an adapter;
        their requests are to fail, the rest of the step runs on."""
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not wanted:
            return None, {}
        self._step += 1
        slot_of: dict[int, int] = {}
        failed: dict[int, str] = {}
        for lora_id, lora in wanted.items():
            try:
                slot_of[lora_id] = self._place(lora, set(wanted))
            except (OSError, ValueError) as e:
                failed[lora_id] = f"LoRA adapter {lora.lora_name!r} could not be read again: {e}"
        if not slot_of:
            return None, failed
        if len(wanted) == 1 and not failed and all(lora is not None for lora in loras):
            return LoRABatch([(next(iter(slot_of.values())), None)]), failed
        slots = np.fromiter(
            (-1 if lora is None else slot_of.get(lora.lora_int_id, -1) for lora in loras),
            np.int64,
            len(loras),
        )
        of_token = np.repeat(slots, np.asarray(query_lens, dtype=np.int64))
        device = next(iter(self.layers.values())).a[0].device
        groups = []
        for slot in sorted(set(slot_of.values())):
            rows = torch.from_numpy(np.flatnonzero(of_token == slot)).to(device)
            groups.append((slot, rows))
        return LoRABatch(groups), failed

    def _place(self, lora: LoRARequest, needed: set[int]) -> int:
        """The slot holding `lora`, written there first if it is not in one."""
        lora_id = lora.lora_int_id
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            free = [i for i, held in enumerate(self.slot_ids) if held is None]
            if free:
                slot = free[0]
            else:
                evictable = [i for i, held in enumerate(self.slot_ids) if held not in needed]
                if not evictable:
                    raise RuntimeError(
                        f"a step uses more adapters than the {len(self.slot_ids)} LoRA slots"
                    )
                slot = min(evictable, key=lambda i: self._slot_use[i])
            self._write(slot, self._adapter(lora))
            self.slot_ids[slot] = lora_id
        self._slot_use[slot] = self._step
        return slot

    def _adapter(self, lora: LoRARequest) -> Adapter:
        adapter = self._host.get(lora.lora_int_id)
        if adapter is None or adapter.request != lora:
            adapter = read_adapter(lora, self.model, self.max_rank)
            logger.info(
                "LoRA adapter %r (id %d, rank %d) read from %s",
                lora.lora_name,
                lora.lora_int_id,
                adapter.rank,
                lora.lora_path,
            )
            self._host[lora.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_int_id)
        return adapter

    def _write(self, slot: int, adapter: Adapter) -> None:
        for slots in self.layers.values():
            slots.clear(slot)
        for part in adapter.layers:
            slots = self.layers[part.module]
            module = self.model.get_submodule(part.module)
            a, b = module.lora_slices(part.shard, part.a, part.b)
            slots.write(slot, slots.shard_index(part.shard), a, b)
