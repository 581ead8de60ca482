"""What the activation pager reports: the figures of its last step, and a readable account."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainstream.units import GB, format_size


@dataclass
class StepFigures:
    paged_bytes: int = 0
    recast_bytes: int = 0
    shared_cast_bytes: int = 0  # repeated casts of one activation, saved as the first
    packs: int = 0  # tensors the hooks saw
    hook_seconds: float = 0.0  # host time inside the hooks (pack and unpack), measured in the profiled step
    paging_seconds: float = 0.0  # the part of it spent paging (a plan that pages nothing does not spend it)
    keeping_seconds: float = 0.0  # and on the tensors kept on the device (skipped too when nothing is paged)
    block_cast_bytes: list = field(default_factory=list)  # recast and shared casts, per block
    outside_cast_bytes: int = 0  # the same outside the blocks
    kept_bytes: int = 0  # activations that paging would move, left on the device
    on_demand: int = 0  # unpacks whose copy had not been prefetched
    held_bytes: int = 0  # paged, but still referenced outside autograd when forward ended
    block_bytes: list = field(default_factory=list)  # what leaving each block on the device costs


def report(pager) -> dict:
    """What the pager did in its last step and what it planned, as figures."""
    plan = pager.plan
    stats = pager.native.stats()
    figures = pager.last
    out = {
        "blocks": f"{pager.blocks_name} x{len(pager.blocks)}",
        "state": "profiling" if pager.profiling else "paging",
        "paged_blocks": pager.paged_upto,
        "recomputed_blocks": len(plan.recomputed) if plan else 0,
        "light_blocks": len(plan.light) if plan else 0,  # recomputed lightly (light.py)
        "pageable_blocks": len(pager.blocks) - pager.keep_last,
        "decision": plan.reason if plan else "profiling: every pageable block paged",
        # (a lean forward counts nothing: the last full count stands, but not for a plan that pages nothing)
        "paged_bytes_per_step": figures.paged_bytes if pager.paged_upto else 0,
        "recast_bytes_per_step": figures.recast_bytes,
        "shared_cast_bytes_per_step": figures.shared_cast_bytes,
        "kept_bytes_per_step": figures.kept_bytes,
        "on_demand_fetches": figures.on_demand,
        "held_elsewhere_bytes_per_step": figures.held_bytes,
        "prefetch_depth": pager.depth,
        "host_memory_kind": pager.native.memory_kind,
        "host_slots": stats["slots"],
        "host_bytes_reserved": stats["reserved_bytes"],
    }
    if pager.profile is not None and plan is not None:
        out.update({
            "d2h_GBps": pager.profile.d2h_bytes_per_s / GB,
            "h2d_GBps": pager.profile.h2d_bytes_per_s / GB,
            "copy_s_per_step": plan.copy_seconds,
            "forward_s": plan.forward_seconds,
            "recompute_s": plan.recompute_seconds,
            "copy_hidden": plan.hidden,
            "expected_peak_GB": plan.expected_peak_bytes / GB if plan.expected_peak_bytes else None,
            "budget_met": plan.budget_met,
        })
    peak = pager.observed_peak_bytes()
    if peak is not None:
        out["observed_peak_GB"] = peak / GB
    return out


def describe(pager) -> str:
    """The report as a few readable lines."""
    r = pager.report()
    light = f", {r['light_blocks']} recomputed lightly (matmul and attention outputs kept)" if r["light_blocks"] else ""
    recomputed = (f", {r['recomputed_blocks']} recomputed" if r["recomputed_blocks"] else "") + light
    if not pager.saved_tensor_hooks:
        how = ("torch's checkpointing inside the compiled graph" if pager.compiled
               else "torch's checkpointing, autocast copies included")
        return (f"activations over {r['blocks']}: {r['recomputed_blocks']} blocks recomputed in backward "
                f"({how}){light}, the rest kept; no saved-tensor hooks ({r['decision']})")
    lines = [f"activation paging over {r['blocks']}: {r['paged_blocks']} paged{recomputed} ({r['decision']})",
             (f"  per step: {r['paged_bytes_per_step'] / GB:.2f} GB paged, "
              f"{r['recast_bytes_per_step'] / GB:.2f} GB of weight casts recomputed, "
              f"{r['shared_cast_bytes_per_step'] / GB:.2f} GB of repeated casts saved once, "
              f"{r['kept_bytes_per_step'] / GB:.2f} GB kept on the device, "
              f"{r['on_demand_fetches']} unpacks not prefetched")]
    if r["held_elsewhere_bytes_per_step"]:
        lines.append(f"  {format_size(r['held_elsewhere_bytes_per_step'])} of it stayed referenced outside "
                     f"autograd (a KV cache?): copied, but not freed")
    if "copy_s_per_step" in r:
        lines.append(f"  copies {r['copy_s_per_step'] * 1e3:.1f} ms each way at {r['d2h_GBps']:.1f}/"
                     f"{r['h2d_GBps']:.1f} GB/s vs forward {r['forward_s'] * 1e3:.1f} ms: "
                     f"{'hidden' if r['copy_hidden'] else 'partly exposed'}")
        if r["recomputed_blocks"] or r["light_blocks"]:
            lines.append(f"  recomputing {r['recomputed_blocks'] + r['light_blocks']} blocks adds "
                         f"{r['recompute_s'] * 1e3:.1f} ms of forward compute to backward")
        if not r["copy_hidden"] and r["paged_bytes_per_step"]:
            if pager.vram_budget is None:
                hint = "a vram_budget pages only what hides and recomputes blocks for the rest, which costs less"
            elif not pager.recompute:
                hint = "Tuning(recompute=True) would recompute blocks instead of paging them, which costs less"
            else:
                hint = "recomputing the other blocks was not enough for the budget"
            lines.append(f"  exposed copies lengthen the step, more so while the host updates (both use "
                         f"host memory); {hint}")
    if r.get("expected_peak_GB") is not None:
        lines.append(f"  peak VRAM expected {r['expected_peak_GB']:.2f} GB, observed "
                     f"{r.get('observed_peak_GB', float('nan')):.2f} GB")
    lines.append(f"  host: {r['host_slots']} {r['host_memory_kind']} slots, "
                 f"{r['host_bytes_reserved'] / GB:.2f} GB reserved")
    return "\n".join(lines)
