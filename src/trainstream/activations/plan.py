"""Which blocks' activations are paged, recomputed or kept: a pure function of a measured profile
(trainstream.activations.pager takes the profile and applies the plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainstream.units import GB


def tensors_in(obj):
    """The tensors in nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def find_blocks(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """The model's repeated blocks: the ModuleList of same-class modules holding most parameters."""
    best, best_key = ("", []), (0, 0)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        key = (sum(p.numel() for p in module.parameters()), len(module))
        if key > best_key:
            best, best_key = (name, list(module)), key
    return best


@dataclass
class Profile:
    """What the profiling step measured."""

    block_bytes: list[int]  # activation bytes that paging frees, per block
    block_seconds: list[float]  # forward time of each block without the hooks' host time (pager._finish_profile)
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    peak_bytes: int | None = None  # peak VRAM of the profiled step (every pageable block paged)
    block_input_bytes: list[int] | None = None  # what a recomputed block still holds: its inputs


@dataclass
class Plan:
    paged_blocks: int  # blocks 0 .. paged_blocks-1 are paged (a recomputed one: its inputs)
    pageable_blocks: int
    reason: str
    paged_bytes: int = 0
    copy_seconds: float = 0.0  # one direction, at the measured bandwidth
    forward_seconds: float = 0.0
    hidden: bool = True  # the copies fit behind the forward compute
    expected_peak_bytes: int | None = None
    budget_met: bool | None = None
    recomputed: tuple[int, ...] = ()  # blocks whose forward runs again in backward (checkpointed)
    recompute_seconds: float = 0.0  # their forward time, added to backward (light ones' cheap ops)
    light: tuple[int, ...] = ()  # blocks whose cheap ops run again in backward (light.py)


def plan_paging(profile: Profile, *, share: float | None = None, vram_budget: int | None = None,
                keep_last: int = 1, recompute: bool = False) -> Plan:
    """Decide how many leading blocks to page, and which to recompute. Pure function of the
    profile: tested on CPU.

    Leading blocks are paged first: their activations wait longest for backward. "auto" and a
    share never page the last ``keep_last`` blocks, which backward needs first, so that their
    copies could not hide; a VRAM budget pages them too when it must, their copy back exposed.

    With ``recompute``, a VRAM budget that the hidden copies do not reach is met by recomputing
    the following blocks instead: a recomputed block keeps only its inputs and runs its forward
    again in backward, which costs far less than a copy that cannot hide (a 0.44 GB block of a
    1B Llama copies in 8 ms each way and computes its forward in 4 ms). If that is not enough,
    more leading blocks are paged; for a recomputed block that means its inputs only.
    """
    n = len(profile.block_bytes)
    pageable = max(0, n - keep_last)
    sizes, times = profile.block_bytes, profile.block_seconds
    inputs = profile.block_input_bytes or [0] * n
    bandwidth = min(profile.d2h_bytes_per_s, profile.h2d_bytes_per_s)
    recomputed: list[int] = []

    def copied_bytes(i: int) -> int:  # what paging block i copies: a recomputed block's inputs only
        return inputs[i] if i in recomputed else sizes[i]

    def hidden(k: int) -> bool:
        # block i's copy may run while blocks up to i+1 compute: the copy stream may lag one block
        copied, computed = 0.0, 0.0
        for i in range(k):
            copied += copied_bytes(i) / bandwidth
            computed += times[i]
            if copied > computed + (times[i + 1] if i + 1 < n else 0.0):
                return False
        return True

    if share is not None:
        k = min(pageable, round(share * pageable))
        reason = f"share={share:g} of the {pageable} pageable blocks"
    else:
        k = 0
        while k < pageable and hidden(k + 1):
            k += 1
        reason = "auto: every block whose copy hides behind forward compute"
    expected = None
    met = None
    if profile.peak_bytes is not None:
        profiled = sum(sizes[pageable:])  # the profile paged the pageable blocks and kept the rest

        def peak(paged, redo):  # what each block keeps on the device: nothing, its inputs, or all
            held = sum(0 if i < paged else inputs[i] if i in redo else sizes[i] for i in range(n))
            return profile.peak_bytes + held - profiled

        if vram_budget is not None:
            start = k
            if recompute:
                for i in range(k, n):
                    if peak(k, recomputed) <= vram_budget:
                        break
                    if sizes[i] > inputs[i]:  # a block checkpointed by the model itself gains nothing
                        recomputed.append(i)
            while k < n and peak(k, recomputed) > vram_budget:
                k += 1
            if k > start or recomputed:
                reason = f"vram_budget={vram_budget / GB:.2f} GB"
            met = peak(k, recomputed) <= vram_budget
            if not met:
                reason += " (not met: every block is paged or recomputed)"
        expected = peak(k, recomputed)
    paged_bytes = sum(copied_bytes(i) for i in range(k))
    return Plan(paged_blocks=k, pageable_blocks=pageable, reason=reason, paged_bytes=paged_bytes,
                copy_seconds=paged_bytes / bandwidth if bandwidth else 0.0,
                forward_seconds=sum(times), hidden=k <= pageable and hidden(k), expected_peak_bytes=expected,
                budget_met=met, recomputed=tuple(recomputed),
                recompute_seconds=sum(times[i] for i in recomputed))
