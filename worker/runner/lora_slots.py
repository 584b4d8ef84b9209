"""Which LoRA adapter each of the model's slots holds, and a step's rows grouped by slot.

A step may run at most as many adapters as there are slots (the scheduler admits no more), so each of
them gets one: the one it already holds, else a free slot, else the least recently used slot that no row
of this step needs, whose adapter is overwritten (it stays loaded in host memory and comes back the next
time a request names it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from nanovllm.common.logging import get_logger
from nanovllm.worker.layers.lora import LoRABatch, LoRAContext, LoRAWeights
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.models.lora_adapter import LoRAAdapter

log = get_logger(__name__)

BASE_ROW = -1  # a row of StepInputs.lora_slots that runs the base model


class AdapterSlots:
    def __init__(self, model: DecoderForCausalLM, context: LoRAContext) -> None:
        self.context = context
        # (layer index, projection name) -> its LoRAWeights, as LoRAAdapter.weights keys them.
        self.layers: dict[tuple[int, str], LoRAWeights] = {}
        for index, layer in enumerate(model.model.layers):
            for name, module in layer.named_modules():
                if isinstance(module, LoRAWeights):
                    self.layers[(index, name.removesuffix(".lora"))] = module
        self.held: OrderedDict[LoRAAdapter, int] = OrderedDict()  # least recently used first
        self.free = list(range(context.num_slots - 1, -1, -1))
        self.num_loads = 0
        self.filled: list[tuple[int, LoRAAdapter]] = []  # (slot, adapter) filled by the last assign

    def assign(self, adapters: Iterable[LoRAAdapter]) -> dict[LoRAAdapter, int]:
        """A slot for each of a step's adapters, filling the ones that do not hold theirs."""
        wanted = list(dict.fromkeys(adapters))
        if len(wanted) > self.context.num_slots:
            raise RuntimeError(
                f"a step runs {len(wanted)} adapters but the model has {self.context.num_slots} slots"
            )
        self.filled = []
        for adapter in wanted:
            if adapter in self.held:
                self.held.move_to_end(adapter)
        for adapter in wanted:
            if adapter not in self.held:
                self._fill(adapter, self._take_slot(wanted))
        return {adapter: self.held[adapter] for adapter in wanted}

    def _take_slot(self, wanted: list[LoRAAdapter]) -> int:
        if self.free:
            return self.free.pop()
        evicted = next(adapter for adapter in self.held if adapter not in wanted)
        log.debug("lora_slot_reused", evicted=evicted.name)
        return self.held.pop(evicted)

    def _fill(self, adapter: LoRAAdapter, slot: int) -> None:
        self.put(slot, adapter)
        self.held[adapter] = slot
        self.filled.append((slot, adapter))
        self.num_loads += 1

    def put(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write `adapter`'s weights into `slot` of every adapted layer (a tensor-parallel rank other than
        0 does just this, as rank 0's StepInputs.lora_fills say)."""
        for key, weights in self.layers.items():
            weights.fill(slot, adapter.weights.get(key, {}))

    def release(self, adapter: LoRAAdapter) -> None:
        """Forget an unloaded adapter's slot (its weights there are never read again)."""
        slot = self.held.pop(adapter, None)
        if slot is not None:
            self.free.append(slot)


def lora_batch(
    row_slots: list[int], num_slots: int, to_device: Callable[[list[int]], torch.Tensor], dtype: torch.dtype
) -> LoRABatch | None:
    """A step's rows grouped by slot, in slot order (BASE_ROW rows in none), or None when no row has an
    adapter."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot != BASE_ROW:
            by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return None
    by_slot = dict(sorted(by_slot.items()))
    slots, rows = list(by_slot), [row for indices in by_slot.values() for row in indices]
    starts = [0]
    for indices in by_slot.values():
        starts.append(starts[-1] + len(indices))
    host = torch.tensor([*rows, *starts, *slots], dtype=torch.long).split(
        [len(rows), len(starts), len(slots)]
    )
    slot_of_row = [slot for slot, indices in by_slot.items() for _ in indices]
    device_rows, row_slot_index = to_device([*rows, *slot_of_row]).split(len(rows))
    flat = dict(zip(("rows", "starts", "slots"), host), device_rows=device_rows, row_slots=row_slot_index)
    if len(slots) == 1:
        every_row = len(rows) == len(row_slots)
        return LoRABatch([(slots[0], None if every_row else device_rows)], **flat)
    groups = [(slot, device_rows[a:b]) for slot, a, b in zip(slots, starts, starts[1:])]
    m = max(len(indices) for indices in by_slot.values())
    padded = [i for indices in by_slot.values() for i in indices + indices[:1] * (m - len(indices))]
    mask = [int(k < len(indices)) for indices in by_slot.values() for k in range(m)]
    slot_index, padded_rows, mask_rows = to_device([*slots, *padded, *mask]).split(
        [len(slots), len(padded), len(mask)]
    )
    every_slot = len(slots) == num_slots  # then in order 0, 1, ...: the slots' weights need no gather
    return LoRABatch(
        groups,
        **flat,
        padded_rows=padded_rows,
        mask=mask_rows.to(dtype).view(len(slots), m, 1),
        slot_index=None if every_slot else slot_index,
    )
