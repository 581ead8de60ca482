"""The checkpoint format: torch.optim.AdamW's state dict, for one process, gathered under DDP and sharded under FSDP2.

Whatever placement wrote a checkpoint, any placement loads it: each state tensor is copied to
where this optimizer keeps it (a host view or a device tensor), and a loaded bf16 master writes
the model's weights.
"""

from __future__ import annotations

import torch

from trainstream import eight_bit
from trainstream.slots import Engine, Slot, Slots


class Checkpoint:
    """State dicts of one optimizer: `param_groups` its groups (shared with torch's optimizer)."""

    def __init__(self, engine: Engine, slots: Slots, param_groups: list, *, data_parallel, shards) -> None:
        self._engine = engine
        self._slots = slots
        self._groups = param_groups
        self._dp = data_parallel
        self._shards = shards

    def state_dict(self, local: dict) -> dict:
        """torch's state dict of this process (`local`), as the caller gets it: under DDP every
        rank's entries gathered (a collective), under FSDP2 each tensor a DTensor shard."""
        if self._dp is not None:
            return self._dp.gather_state(local)
        if self._shards is not None:
            return self._sharded(local)
        return local

    def _sharded(self, local: dict) -> dict:
        """Under FSDP2, torch AdamW's format as FSDP2 gives it (and torch.distributed.checkpoint
        saves it): each state tensor a DTensor sharded as its parameter, whose local part is this
        rank's host copy; ranks whose shard of a parameter is empty hold empty parts."""
        index = {id(p): i for group, saved in zip(self._groups, local["param_groups"])  # torch's numbering
                 for p, i in zip(group["params"], saved["params"])}
        state = {}
        for slot in self._slots.order:
            i = index[id(slot.param)]
            entry = local["state"].get(i) if not slot.peer else None
            if entry is None:  # an empty shard: what the ranks that hold some of it have, with no elements
                empty = torch.zeros(slot.weight.shape, dtype=torch.float32)
                entry = {"step": torch.tensor(float(slot.step)), "exp_avg": empty, "exp_avg_sq": empty.clone()}
                if slot.param.dtype == torch.bfloat16:
                    entry["master_param"] = empty.clone()
            state[i] = {k: self._shards.as_shard_of(v, slot.param) if k != "step" else v for k, v in entry.items()}
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}

    def load(self, state_dict: dict) -> None:
        """Loads a torch.optim.AdamW (or our own) state dict. Under DDP, every rank loads the
        whole dict and keeps what it owns."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, optimizer has "
                             f"{len(self._groups)}")
        index = {}
        for group, saved in zip(self._groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("state dict param group sizes do not match the optimizer's")
            for p, i in zip(group["params"], saved["params"]):
                index[i] = p
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        for i, state in state_dict["state"].items():
            p = index[i]
            slot = self._slots.get(p)
            if slot is None or slot.peer:
                continue
            weight = slot.weight
            for key in ("exp_avg", "exp_avg_sq"):
                saved = state[key]
                if not (slot.quantized or hasattr(saved, "codes")):
                    saved = self._local(saved, slot)
                eight_bit.load_moment(slot.state[key], saved, self._slots.name(slot), key)
            slot.step = int(state["step"])
            slot.state["step"].fill_(slot.step)
            if "master_param" in state and "master_param" in slot.state:
                slot.state["master_param"].copy_(self._local(state["master_param"], slot))
                with torch.no_grad():
                    weight.copy_(slot.state["master_param"].to(weight.device, weight.dtype))
                slot.version = weight._version
            elif weight._version != slot.version:  # the model's weights were loaded: the master follows them
                if not slot.resident:
                    self._engine.pipeline.load_weights(slot.host, weight.data_ptr(), self._engine.current_stream())
                elif "master_param" in slot.state:
                    slot.state["master_param"].copy_(weight.detach())
                slot.version = weight._version

    def _local(self, value: torch.Tensor, slot: Slot) -> torch.Tensor:
        """A saved state tensor as this process holds it: under FSDP2, this rank's shard of it."""
        value = value.detach()
        if self._shards is not None:
            value = self._shards.local_of(value, slot.param)
        return value.reshape(slot.weight.shape)
