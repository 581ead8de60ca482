"""What an optimizer holds where, and why: describe()'s lines for a person, report()'s figures for a program."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import torch

from trainstream import eight_bit
from trainstream import placement as planner
from trainstream.clipping import Clipping
from trainstream.promotion import Promotion
from trainstream.slots import Engine, Slot, Slots
from trainstream.units import format_size


# VRAM other tensors hold at wrap() that describe() mentions (allocator workspaces stay under it)
ELSEWHERE_FLOOR = 256 << 20


class Reporter:
    """describe() and report() of one optimizer, from its rooms' public state. `host_memory()`
    gives the host bytes TrainStream holds by role (OffloadedAdamW.host_memory); `data_parallel`
    and `shards` are the DDP and FSDP2 engines (None when not in use)."""

    def __init__(self, engine: Engine, slots: Slots, clipping: Clipping, tiers: Promotion, *,
                 host_memory: Callable[[], dict], data_parallel, shards, eight_bit: bool = False) -> None:
        self._engine = engine
        self._eight_bit = eight_bit  # the optimizer is torchao's AdamW8bit
        self._host_memory = host_memory
        self._slots = slots
        self._clipping = clipping
        self._tiers = tiers
        self._dp = data_parallel
        self._shards = shards

    # --------------------------------------------------------------------- describe()
    def describe(self) -> str:
        order, tiers = self._slots.order, self._tiers
        lines = []
        if tiers.plan is not None and tiers.profile is not None:
            lines.append(planner.describe(tiers.plan, tiers.profile))
        else:
            resident = sum(s.resident for s in order)
            offloaded = sum(s.offloaded for s in order)
            state = "profiling the first steps in the first plan's placement" if tiers.profiler else "fixed"
            lines.append(f"placement ({state}): {resident} of {len(order)} parameters keep gradient and "
                         f"AdamW state in VRAM, {offloaded} offloaded to host memory")
            if tiers.first_plan is not None:
                lines.append(tiers.first_plan.describe())
        streamer = tiers.streamer
        if streamer is not None and (tiers.plan is None or not tiers.plan.streamed):
            lines.append(f"weights: {len(streamer.modules)} blocks' ({streamer.weight_bytes / 1e9:.2f} GB) "
                         f"stream from host memory, one block ahead of their use")
        summed = sum(self._slots.sums_on_host(s) for s in order)
        if summed and self._engine.device.type == "cuda" and self._dp is None:
            how = ("copied down and added by the host engine's threads" if not self._engine.pipeline.device_accumulate
                   else "added by a GPU kernel that reads and writes them over PCIe")
            lines.append(f"micro-batches: {summed} parameters summed in host memory, {how}")
        compact = self._optimizer_line()
        if compact:
            lines.append(compact)
        host = self._host_memory_line()
        if host:
            lines.append(host)
        elsewhere = self._elsewhere_line()
        if elsewhere:
            lines.append(elsewhere)
        clipping = self._clipping_line()
        if clipping:
            lines.append(clipping)
        share = self.distributed()
        if share is not None:
            what = ("parameters; the others' new weights come from their owners" if self._dp is not None else
                    "parameters' shards; FSDP2 all-gathers the weights")
            lines.append(f"{share['engine']}: rank {share['rank']} of {share['world_size']} updates "
                         f"{share['owned_params']} of {len(order)} {what} "
                         f"({share['owned_elements'] / 1e6:.1f}M elements of state on this host)")
        if tiers.active_pager is not None:
            lines.append(tiers.active_pager.describe())
        return "\n".join(lines)

    def _optimizer_line(self) -> str:
        """Under torchao's AdamW8bit, which parameters keep 8-bit moments ("" otherwise)."""
        order = self._slots.order
        quantized = [s for s in order if s.quantized]
        if not self._eight_bit:
            return ""
        numel = sum(s.weight.numel() for s in order)
        share = sum(s.weight.numel() for s in quantized) / max(numel, 1)
        stochastic = sum(s.stochastic for s in order)
        rounded = (f"; {stochastic} of them bf16 weights without an fp32 master, rounded stochastically "
                   f"(bf16_stochastic_round=True)" if stochastic else "")
        return (f"optimizer: torchao AdamW8bit: {len(quantized)} parameters ({share:.1%} of the elements) keep "
                f"blockwise 8-bit moments, the other {len(order) - len(quantized)} (under {eight_bit.MIN_QUANTIZED} "
                f"elements or not whole blocks of {eight_bit.BLOCK_SIZE}) fp32 moments{rounded}")

    def _clipping_line(self) -> str:
        """How many offloaded updates start before the global norm is known, what that holds, and
        how the windows went; how many wait for the norm."""
        offloaded = sum(1 for s in self._slots.order if s.offloaded and not s.peer)
        if self._clipping.max_grad_norm is None or not offloaded:
            return ""
        spec = self._clipping.speculation
        if not spec["params"]:
            off = "" if self._clipping.on else " (speculative_clipping is off)"
            return f"clipping: the updates of all {offloaded} offloaded parameters wait for the global norm{off}"
        held = (f", up to {spec['vram_term_bytes'] / 1e9:.2f} GB of VRAM for fp32 terms awaiting the verdict"
                if spec["vram_term_bytes"] else "")
        rest = offloaded - spec["params"]
        return (f"clipping: {spec['params']} offloaded parameters start their update before the global norm is known "
                f"({spec['host_bytes'] / 1e9:.2f} GB of host memory for it{held})"
                + (f", the other {rest} wait for it" if rest else "")
                + f"; windows committed {spec['hits']}, redone {spec['misses']}, waited after a clip {spec['waited']}")

    def _host_memory_line(self) -> str:
        """Host memory by what it holds, per parameter that has host state, against the host
        budget ("" if none is held)."""
        pipeline, holds = self._engine.pipeline, self._host_memory()
        used, paging = pipeline.host_used_bytes, holds["activation_slots"]
        if not used and not paging:
            return ""
        slots = [s for s in self._slots.order if s.host is not None and s.host.holds_state]
        held = ["fp32 master" if not any(s.stochastic for s in slots) else "fp32 master or bf16 weights",
                "two moments" if not any(s.quantized for s in slots) else "8-bit or fp32 moments"]
        if any(s.host.has_landing_buffer for s in slots):
            held.append("a gradient buffer")
        if any(s.host.has_accumulator for s in slots):
            held.append("an fp32 sum of micro-batches")
        if any(s.streamed and s.param.dtype == torch.bfloat16 and not s.stochastic for s in slots):
            held.append("streamed bf16 weights")
        numel = sum(s.weight.numel() for s in slots)
        parts = [f"{format_size(used)} {pipeline.host_memory_kind} for the offloaded state"
                 + (f" ({used / numel:.1f} B a parameter: {', '.join(held)})" if numel else "")]
        if holds["state"] > 1.05 * used:  # (the arena takes memory in slabs of 256 MiB)
            parts[0] += f" in {format_size(holds['state'])} of slabs"
        if paging:
            parts.append(f"{format_size(paging)} of slots for paged activations")
        if holds["streamed_frozen_weights"]:
            parts.append(f"{format_size(holds['streamed_frozen_weights'])} of streamed frozen weights")
        # (speculation's share: on the clipping line)
        return f"host memory: {self._engine.host_budget.describe(sum(holds.values()))}: " + ", ".join(parts)

    def _elsewhere_line(self) -> str:
        """What the rest of the process held at wrap() that this plan had to leave alone ("" if
        nothing worth a mention)."""
        held = self._engine.elsewhere
        parts = []
        if held.vram_bytes >= ELSEWHERE_FLOOR:
            parts.append(f"{format_size(held.vram_bytes)} of VRAM held by tensors that are not this model's "
                         f"(counted against the VRAM budget)")
        if held.host_bytes:
            parts.append(f"{format_size(held.host_bytes)} of host memory held by {held.host_optimizers} other "
                         f"TrainStream optimizer(s) still alive (outside the host budget; remove_hooks() and "
                         f"dropping them gives it back)")
        if not parts:
            return ""
        return ("elsewhere in this process at wrap(): " + "; ".join(parts)
                + ". A fresh process, or freeing them before wrap(), plans with that room")

    # ----------------------------------------------------------------------- report()
    def report(self) -> dict:
        order, pipeline, clipping, tiers = self._slots.order, self._engine.pipeline, self._clipping, self._tiers
        numel = sum(s.weight.numel() for s in order)
        fp32 = [s for s in order if s.param.dtype == torch.float32 and s.offloaded]
        packed = sum(s.weight.numel() for s in fp32 if s.host.last_gradient_as_bf16)
        staging = self._engine.staging
        return {
            "trainable_params": numel,
            "host_memory_kind": pipeline.host_memory_kind,
            "host_bytes_reserved": pipeline.host_reserved_bytes,
            "host_bytes_used": pipeline.host_used_bytes,
            "host_bytes_per_param": pipeline.host_used_bytes / max(numel, 1),
            "optimizer": "torchao.optim.AdamW8bit" if self._eight_bit else "torch.optim.AdamW",
            "quantized_params": sum(s.quantized for s in order),  # blockwise 8-bit moments
            "stochastic_params": sum(s.stochastic for s in order),  # bf16 weights without a master
            # everything TrainStream holds in host memory, by role, and the budget it is held under
            "host_budget": {"limit_bytes": self._engine.host_budget.limit, "source": self._engine.host_budget.source,
                            "available_bytes": self._engine.host_budget.available,
                            "margin_bytes": self._engine.host_budget.margin, "held_bytes": self._host_memory()},
            # what the rest of the process held at wrap(): VRAM of other tensors, host memory of
            # other live TrainStream optimizers
            "held_elsewhere_at_wrap": self._engine.elsewhere.as_dict(),
            "isa": pipeline.isa,
            "threads": pipeline.threads,
            "engine_niceness": pipeline.niceness,  # how much nicer than the training loop they run
            "accumulation_steps": self._slots.accumulation_steps,
            "max_grad_norm": clipping.max_grad_norm,
            "last_grad_norm": clipping.last_grad_norm,
            # share of offloaded fp32 weights whose last gradient was bf16-exact (under bf16
            # autocast, the matmuls') and crossed as bf16; each one is tested, so none is rounded
            "gradients_sent_as_bf16": packed / max(sum(s.weight.numel() for s in fp32), 1),
            # VRAM besides the weights: the buffer fp32 update terms cross through (64 MiB at most)
            "vram_staging_bytes": staging.nbytes if staging is not None else 0,
            "placement": self._placement_report(),
            "speculation": dict(clipping.speculation),  # clipping without waiting (OffloadedAdamW.speculation)
            "activations": tiers.active_pager.report() if tiers.active_pager else "off",
            # under DDP or FSDP2: this rank, and the parameters (or shards) whose state and updates are its own
            "distributed": self.distributed(),
        }

    def distributed(self) -> dict | None:
        engine = self._dp or self._shards
        if engine is None:
            return None
        order = self._slots.order
        return {"engine": "DistributedDataParallel" if self._dp is not None else "FSDP2",
                "rank": engine.rank, "world_size": engine.world,
                "owned_params": sum(not s.peer for s in order),
                "owned_elements": sum(s.weight.numel() for s in order if not s.peer)}

    def _owner(self, slot: Slot) -> str:
        return f"rank {self._dp.owners[slot.index]}" if self._dp is not None else "other ranks (empty shard here)"

    def _placement_report(self) -> dict:
        tiers, order = self._tiers, self._slots.order
        plan, placement, acc = tiers.plan, tiers.placement, self._slots.accumulation_steps
        streamer = tiers.streamer
        out = {
            "mode": placement if isinstance(placement, str) else f"share {placement:g}",
            "state": tiers.state,
            "resident_params": sum(s.resident for s in order),
            "offloaded_params": sum(s.offloaded for s in order),
            "vram_budget_bytes": tiers.vram_budget,
            "streamed_blocks": len(streamer.modules) if streamer is not None else 0,
            "streamed_weight_bytes": streamer.weight_bytes if streamer is not None else 0,
            "params": [{
                "name": self._slots.name(s), "numel": s.param.numel(),
                "weight": "host (streamed)" if s.streamed else "vram",
                "gradient": "vram" if s.resident else "host" if not s.peer else self._owner(s),
                "state": "vram" if s.resident else "host" if not s.peer else self._owner(s),
                "window_sum": None if acc == 1 else "vram" if s.resident or s.sum_in_vram else "host",
            } for s in order],
            "first_plan": asdict(tiers.first_plan) if tiers.first_plan is not None else None,
        }
        if plan is not None:
            profile = tiers.profile
            out.update({
                "blocks": planner.block_kinds(plan, profile) if profile else [],
                "recomputed": list(plan.recomputed), "recomputed_lightly": list(plan.light),
                "saved_tensor_hooks": plan.hooks,
                "expected_peak_bytes": plan.expected_peak, "reserve_bytes": plan.reserve,
                "observed_peak_bytes": plan.observed_peak,
                "expected_step_s": plan.expected_step_s, "step_terms": dict(plan.step_terms),
                "moves": list(plan.moves),
                # what the plan was made from, for a person comparing it with what ran
                "profile": asdict(profile) if profile is not None else None,
            })
        return out
