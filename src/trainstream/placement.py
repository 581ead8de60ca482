"""Where every byte of a training step lives: a pure function from a measured profile to a plan.

The profile comes from training steps run in a placement that fits (the first plan's, from
shapes: trainstream.first_plan; every block but the last paged, or none where that plan has room
to spare). The planner starts
from the fastest placement, everything in VRAM as plain PyTorch keeps it, and while the expected
peak is over the budget takes the cheapest way to save VRAM, measured in seconds added per GB
saved:

* offload the AdamW state and gradient of the last resident parameter in forward order (its
  gradient arrives first in backward, so its host update has the longest to hide; the first
  parameters in forward order stay on the GPU longest),
* sum an offloaded parameter's micro-batches on the host rather than in VRAM (accumulation),
* turn the saved-tensor hooks on (autocast's copies of the weights recomputed in backward, an
  activation's repeated casts saved once), page the next leading block's activations to host
  memory, or recompute a block in backward from its inputs,
* and, last, when nothing else is left: stream the weights of the last block not yet streamed
  from host memory (trainstream.streaming), one block ahead of its use.

Both sides are modelled from the profile: the peak from the profiled memory curve (the forward's
peak and the peak before each gradient arrives) plus what each choice keeps, the step time from a
simulation of the gradient downloads, the host engine (updates in forward order as gradients
land, or after the global norm with clipping), the uploads and the next forward's waits for them.
Nothing here touches torch: it is tested on CPU with made-up profiles.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields, replace

GB = 1e9
RESERVE_FRACTION = 0.02  # of the budget, for the model's error: the plan's peak stays under the rest
MIN_RESERVE = 256 << 20
STEP_FRACTION = 0.01  # offload moves take at least this share of the parameters' bytes at a time
PAGING_HOST_SLOWDOWN = 1.2  # the host engine while paging copies share host memory (measured: 18%)
# What each second of host updates adds to the step while the GPU's work is queued by threads that
# share the CPU with the engine: the backward (autograd's thread, a recomputed block's forward),
# the device update and the next forward, a Llama's being host-bound. Measured on a 16-core Xeon,
# 0.95B Llama: 36 ms of updates after backward made the forward 23 ms longer, 24 ms of them 15 to
# 18 ms longer; without clipping, 57 ms of updates during a backward of 71 ms (10 blocks
# recomputed) made it 19 to 37 ms longer, and with every parameter offloaded 180 ms of them
# stretched a 51 ms backward to 105-151 ms.
HOST_CONTENTION = 0.6


@dataclass(frozen=True)
class ParamCost:
    """One trainable parameter, in forward order, as the profile saw it."""

    name: str
    numel: int
    element_size: int  # of the weights: 4 (fp32) or 2 (bf16)
    block: int  # its repeated block; -1 before the blocks, len(blocks) after them
    need_s: float  # forward: when its module starts, after the forward's start
    arrival_s: float  # backward: when its gradient is complete, after the forward's end
    segment_peak: int  # profiled peak VRAM between the previous gradient's arrival and this one's
    moment_bytes: float = 8.0  # bytes an element of its two moments: 8 in fp32, 2 + 8/256 in 8 bits
    master: bool = True  # bf16 weights keep an fp32 master (not when rounded stochastically)


@dataclass(frozen=True)
class BlockCost:
    """One repeated block's saved activations."""

    bytes: int  # what paging it frees (kept: all of it stays in VRAM until its backward)
    input_bytes: int  # what recomputing it keeps: its inputs
    forward_s: float
    cast_bytes: int = 0  # autocast copies that the hooks recompute or save once; kept without hooks
    weight_bytes: int = 0  # its weights (trainable or not), which streaming takes off the device
    streamable: bool = True  # no weight of it is used outside it (tied weights stay)
    light_bytes: int | None = None  # what light recompute keeps besides its inputs (None: not offered)
    light_s: float = 0.0  # what light recompute adds to backward: the cheap ops run again
    recompute_s: float | None = None  # what recomputing it whole adds to backward (None: forward_s)
    # the model recomputes it itself (its own gradient checkpointing): what it keeps is what that
    # leaves, and recomputing it again would run its forward twice in backward
    checkpointed: bool = False


@dataclass
class Profile:
    params: list[ParamCost]
    blocks: list[BlockCost]
    accumulation_steps: int
    clipping: bool
    forward_s: float
    backward_s: float
    forward_peak: int  # peak VRAM of the profiled forward
    tail_peak: int  # from the last gradient to the end of the step
    host_s_per_param: float  # host engine, all threads: seconds per parameter updated
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    device_bytes_per_s: float  # VRAM bandwidth, for the GPU update
    profiled_paged: int = 0  # leading blocks the profile paged (the rest kept)
    profiled_hooks: bool = False
    outside_cast_bytes: int = 0  # autocast copies of weights outside the blocks (an LM head's)
    hook_s: float = 0.0  # what the saved-tensor hooks cost a micro-batch
    lean_hook_s: float | None = None  # the same when nothing is paged (kept tensors skip the bookkeeping)
    weight_bytes: int = 0  # every weight in VRAM, trainable or not, for the figures
    fixed_activations: bool = False  # the activation choices are the user's: no moves on them
    streamed: int = 0  # the last blocks whose weights the profiled steps streamed (they stay streamed)
    profiled_resident: int = 0  # the first parameters resident in the profiled steps (the first plan's)
    stream_depth: int = 1  # streamed blocks fetched ahead of the one in use (Tuning.prefetch_depth)
    host_room: int | None = None  # host bytes paged activations may take (pinned slots already held included)
    recompute: bool = True  # blocks may run their forward again (Tuning(recompute=False): never)
    # How micro-batches reach the host sums (Tuning.add_on_host): False, a kernel reading each sum
    # back over PCIe (as in profiles recorded before the choice); True, the engine's threads; None,
    # the planner's choice (adds_on_host)
    add_on_host: bool | None = False
    # The engine's threads' time adding one micro-batch's element into its host sum, all threads
    # at once: measured where the profiled steps added on the host, else None (not counted)
    host_add_s_per_element: float | None = None


@dataclass
class Plan:
    """A placement. Parameters are in forward order: the first `resident` keep gradient and AdamW
    state in VRAM; of the others, the first `vram_sums` (fp32 weights) sum micro-batches in
    VRAM; the rest sum them in host memory."""

    resident: int
    vram_sums: int = 0
    hooks: bool = False
    paged: int = 0  # leading blocks paged (a recomputed one: its inputs)
    recomputed: tuple[int, ...] = ()
    light: tuple[int, ...] = ()  # blocks recomputed lightly: their matmuls' outputs kept
    streamed: int = 0  # the last blocks whose weights stream from host memory
    budget: int | None = None
    reserve: int = 0
    expected_peak: int = 0
    expected_step_s: float = 0.0
    step_terms: dict = field(default_factory=dict)
    fits: bool = True
    moves: list[str] = field(default_factory=list)
    observed_peak: int | None = None  # set once a planned step has run

    def __post_init__(self) -> None:
        both = sorted(set(self.recomputed) & set(self.light))
        if both:
            raise ValueError(f"blocks {both} are both recomputed and recomputed lightly: a block is one or the other")

    def key(self) -> tuple:
        return self.resident, self.vram_sums, self.hooks, self.paged, self.recomputed, self.light, self.streamed


# ---------------------------------------------------------------------------------- bytes
def state_bytes(p: ParamCost, acc: int) -> int:
    """VRAM a resident parameter's optimizer holds for the whole step: the moments, and for bf16
    weights the fp32 master (unless rounded stochastically) and the fp32 sum of micro-batches."""
    moments = round(p.moment_bytes * p.numel)
    if p.element_size == 4:
        return moments
    return moments + ((4 if p.master else 0) + (4 if acc > 1 else 0)) * p.numel


def resident_grad_bytes(p: ParamCost, acc: int) -> int:
    """A resident parameter's gradient, alive from its arrival to the step (bf16 weights with
    accumulation add each micro-batch into the fp32 sum and free it)."""
    if p.element_size == 4:
        return 4 * p.numel
    return 0 if acc > 1 else 2 * p.numel


def _vram_sum(profile: Profile, plan: Plan, i: int) -> bool:
    p = profile.params[i]
    return (profile.accumulation_steps > 1 and p.element_size == 4
            and plan.resident <= i < plan.resident + plan.vram_sums)


def held_bytes(profile: Profile, plan: Plan, j: int) -> int:
    """What block j keeps in VRAM from its forward to its backward under `plan`."""
    b = profile.blocks[j]
    paged_inputs = plan.hooks and j < plan.paged  # (a recomputed block's inputs are paged with it)
    if j in plan.recomputed:  # (its autocast copies are recomputed with it, hooks or not)
        return 0 if paged_inputs else b.input_bytes
    if j in plan.light:  # the same, and the outputs of its matmuls and attention
        return b.light_bytes + (0 if paged_inputs else b.input_bytes)
    if not plan.hooks:
        return b.bytes + b.cast_bytes
    if j < plan.paged:
        return 0
    return b.bytes


def streamed_blocks(profile: Profile, count: int) -> range:
    """The blocks that stream when `count` do: the last ones."""
    n = len(profile.blocks)
    return range(n - count, n)


def last_streamable(streamable: list[bool]) -> int:
    """How many of the last blocks may stream: those after the last one that may not (it holds a
    tied weight)."""
    count = 0
    for ok in reversed(streamable):
        if not ok:
            break
        count += 1
    return count


def in_flight_bytes(block_bytes: list[int], depth: int) -> int:
    """VRAM streamed blocks of these sizes hold at most: the block in use and the `depth` fetched
    ahead of it, instead of all of them."""
    return sum(sorted(block_bytes)[-(depth + 1):])


def weights_on_device(weight_bytes: int, block_bytes: list[int], streamed: int, depth: int) -> int:
    """VRAM a model's weights (`weight_bytes` in all, its blocks' `block_bytes`) take at most when
    the last `streamed` blocks stream with prefetch depth `depth`."""
    last = block_bytes[len(block_bytes) - streamed:] if streamed else []
    return weight_bytes - sum(last) + in_flight_bytes(last, depth)


def streamable(profile: Profile) -> int:
    """How many of the last blocks may stream."""
    return last_streamable([b.streamable for b in profile.blocks])


def streamed_weight_bytes(profile: Profile, count: int) -> int:
    """VRAM the weights of the last `count` blocks hold when streamed."""
    return in_flight_bytes([profile.blocks[j].weight_bytes for j in streamed_blocks(profile, count)],
                           profile.stream_depth)


def device_weight_bytes(profile: Profile, streamed: int) -> int:
    """VRAM the model's weights take at most when the last `streamed` blocks stream."""
    return weights_on_device(profile.weight_bytes, [b.weight_bytes for b in profile.blocks], streamed,
                             profile.stream_depth)


def _streaming_delta(profile: Profile, plan: Plan) -> int:
    """VRAM the plan's streaming takes or gives back against the profiled steps'."""
    return device_weight_bytes(profile, plan.streamed) - device_weight_bytes(profile, profile.streamed)


def _resident_terms(profile: Profile, resident: int) -> tuple[int, list[int]]:
    """(state bytes, each parameter's gradient bytes) of the first `resident` parameters kept in VRAM."""
    acc, params = profile.accumulation_steps, profile.params
    state = sum(state_bytes(p, acc) for p in params[:resident])
    return state, [resident_grad_bytes(p, acc) if i < resident else 0 for i, p in enumerate(params)]


def peak_bytes(profile: Profile, plan: Plan) -> int:
    """The expected peak VRAM of a step under `plan`: the profiled curve, less the state and
    gradients of the parameters resident while it was measured, plus the plan's."""
    acc = profile.accumulation_steps
    params = profile.params
    n = len(profile.blocks)
    baseline = Plan(resident=profile.profiled_resident, hooks=profile.profiled_hooks, paged=profile.profiled_paged)
    delta = [held_bytes(profile, plan, j) - held_bytes(profile, baseline, j) for j in range(n)]
    outside = 0 if plan.hooks or not profile.profiled_hooks else profile.outside_cast_bytes
    state, grads = _resident_terms(profile, plan.resident)
    # the profiled micro-batch held its residents' state throughout and their gradients from arrival
    profiled_state, profiled_grads = _resident_terms(profile, profile.profiled_resident)
    # alive through every forward after a window's first: gradients summed in VRAM
    always = sum(4 * p.numel for i, p in enumerate(params) if _vram_sum(profile, plan, i))
    if acc > 1:
        always += sum(grads)
        grads = [0] * len(params)
    forward = profile.forward_peak - profiled_state + sum(delta) + outside
    worst = max(forward, profile.tail_peak - profiled_state - sum(profiled_grads) + sum(grads))
    arrived = 0
    prefix = [0]
    for d in delta:
        prefix.append(prefix[-1] + d)
    for i in sorted(range(len(params)), key=lambda i: params[i].arrival_s):
        p = params[i]
        held = prefix[max(0, min(p.block, n))] + (outside if p.block >= n else 0)
        worst = max(worst, p.segment_peak - profiled_state + held + arrived)
        arrived += grads[i] - profiled_grads[i]
    return state + always + worst + _streaming_delta(profile, plan)


def block_kinds(plan: Plan, profile: Profile) -> list[str]:
    """What the plan does with each block's activations: "paged", "recomputed", "recomputed
    lightly", "recomputed by the model" (its own checkpointing, left as it is) or "kept"."""
    return ["paged" if plan.hooks and j < plan.paged else "recomputed" if j in plan.recomputed
            else "recomputed lightly" if j in plan.light else "recomputed by the model" if b.checkpointed
            else "kept" for j, b in enumerate(profile.blocks)]


def _paged_block_bytes(profile: Profile, plan: Plan) -> list[int]:
    """What each paged block sends to host memory a step: its activations, or a recomputed
    block's inputs."""
    if not plan.hooks or not profile.blocks:
        return []
    return [profile.blocks[i].input_bytes if i in plan.recomputed + plan.light else profile.blocks[i].bytes
            for i in range(plan.paged)]


def paged_host_bytes(profile: Profile, plan: Plan) -> int:
    """Host memory the plan's paged activations take (pinned slots, reused every step)."""
    return sum(_paged_block_bytes(profile, plan))


def _host_holds(profile: Profile, plan: Plan) -> bool:
    return profile.host_room is None or paged_host_bytes(profile, plan) <= profile.host_room


# ----------------------------------------------------------------------------------- time
def _exposed_paging_s(profile: Profile, plan: Plan) -> tuple[float, int]:
    """(seconds of copies that do not hide behind forward compute, both directions; bytes paged
    a step). Block i's copy may run while blocks up to i + 1 compute."""
    blocks = profile.blocks
    bandwidth = min(profile.d2h_bytes_per_s, profile.h2d_bytes_per_s)
    if not plan.hooks or not blocks or plan.paged == 0 or bandwidth <= 0:
        return 0.0, 0  # (fixed activation choices come with no blocks: the same in every plan)
    copied = computed = lag = 0.0
    paged_bytes = 0
    for i, nbytes in enumerate(_paged_block_bytes(profile, plan)):
        paged_bytes += nbytes
        copied += nbytes / bandwidth
        computed += blocks[i].forward_s
        following = blocks[i + 1].forward_s if i + 1 < len(blocks) else 0.0
        lag = max(lag, copied - computed - following)
    return 2 * lag, paged_bytes  # the prefetch in backward is the same copy back


def _exposed_streaming_s(profile: Profile, plan: Plan) -> float:
    """Seconds of streamed weight copies that do not hide behind compute in a micro-batch: in
    forward a block's copy runs beside the block before it, in backward beside the backward (and
    recompute) of the block after it, about twice its forward."""
    if not plan.streamed or profile.h2d_bytes_per_s <= 0:
        return 0.0
    exposed = 0.0
    for j in streamed_blocks(profile, plan.streamed):
        copy = profile.blocks[j].weight_bytes / profile.h2d_bytes_per_s
        f = profile.blocks[j].forward_s
        recomputed = 0.0 if not plan.hooks else f if j in plan.recomputed else \
            profile.blocks[j].light_s if j in plan.light else 0.0
        exposed += max(0.0, copy - f) + max(0.0, copy - 2 * f - recomputed)
    return exposed


def recompute_seconds(profile: Profile, plan: Plan) -> float:
    """What recomputing adds to backward: the recomputed blocks' forwards, the light ones' cheap ops."""
    blocks = profile.blocks
    whole = [blocks[j].forward_s if blocks[j].recompute_s is None else blocks[j].recompute_s for j in plan.recomputed]
    return sum(whole) + sum(blocks[j].light_s for j in plan.light)


def adds_on_host(profile: Profile, plan: Plan) -> bool:
    """Whether the engine's threads add micro-batches into the host sums under `plan` (else a
    kernel that reads each sum back over PCIe, which competes with streamed weights for the link).
    Left to the planner, where weights stream and the offloaded ones are bf16 (whose landing
    buffers exist anyway: an fp32 weight's gradients land in its sum)."""
    return adds_on_host_by_default(profile.add_on_host, plan.streamed,
                                   [p.element_size for p in profile.params[plan.resident:]])


def adds_on_host_by_default(add_on_host: bool | None, streamed: int, offloaded_sizes: list[int]) -> bool:
    """adds_on_host's rule, from the figures a first plan has too: the user's Tuning.add_on_host,
    else whether weights stream and every offloaded parameter is bf16."""
    if add_on_host is not None:
        return add_on_host
    return streamed > 0 and all(size == 2 for size in offloaded_sizes)


def host_adding_seconds(profile: Profile, plan: Plan) -> float:
    """The engine's threads' time adding one micro-batch into the host sums under `plan` (where
    they add, and their rate was measured; else 0)."""
    if profile.accumulation_steps == 1 or profile.host_add_s_per_element is None or not adds_on_host(profile, plan):
        return 0.0
    summed = [p.numel for i, p in enumerate(profile.params[plan.resident:], plan.resident) if not _vram_sum(profile, plan, i)]
    return profile.host_add_s_per_element * sum(summed)


def step_seconds(profile: Profile, plan: Plan) -> tuple[float, dict]:
    """The expected time of one optimizer step (all its micro-batches) under `plan`, and what it
    is made of."""
    acc = profile.accumulation_steps
    params = profile.params
    recompute = recompute_seconds(profile, plan)
    hooks = 0.0
    if plan.hooks:
        lean = plan.paged == 0 and profile.lean_hook_s is not None
        hooks = profile.lean_hook_s if lean else profile.hook_s
    paging, paged_bytes = _exposed_paging_s(profile, plan)
    streaming = _exposed_streaming_s(profile, plan)
    backward = profile.backward_s + recompute
    micro = profile.forward_s + backward + hooks + paging + streaming
    offloaded = list(range(plan.resident, len(params)))
    link = min(profile.d2h_bytes_per_s, profile.h2d_bytes_per_s)
    host_sums = [i for i in offloaded if not _vram_sum(profile, plan, i)]
    # micro-batches summed into host memory: a kernel reads and writes the fp32 sum over PCIe (the
    # Llama-3-8B shape under 24 GB on an H100 took 10.53 s a step so, 3.45 s of it summing, where
    # the engine's threads added them in 7.81 s); the threads' adds hide behind the next
    # micro-batch, and what they cannot finish within it holds that one's gradients back
    summing = 0.0
    if acc > 1 and not adds_on_host(profile, plan):
        summing = (acc - 1) * sum(4 * params[i].numel for i in host_sums) / link
    elif acc > 1:
        summing = (acc - 1) * max(0.0, host_adding_seconds(profile, plan) - micro)

    # The last backward hands the offloaded gradients over; the host engine updates them, in
    # forward order among those that have landed (after the global norm, when clipping); the
    # uploads follow; the next forward waits for the weights it reaches.
    stretch = backward / profile.backward_s if profile.backward_s > 0 else 1.0
    landed: dict[int, float] = {}
    clock = 0.0
    for i in sorted(offloaded, key=lambda i: params[i].arrival_s):
        p = params[i]
        nbytes = 4 * p.numel if (acc > 1 or p.element_size == 4) else 2 * p.numel
        clock = max(clock, p.arrival_s * stretch) + nbytes / profile.d2h_bytes_per_s
        landed[i] = clock
    norm_ready = max(landed.values(), default=0.0)
    if profile.clipping:
        available = {i: max(backward, norm_ready) for i in offloaded}
    else:
        available = landed
    rate = profile.host_s_per_param * (PAGING_HOST_SLOWDOWN if paged_bytes else 1.0)
    order = sorted(offloaded, key=lambda i: available[i])
    finished: list[tuple[float, int]] = []
    busy: list[tuple[float, float]] = []  # when the engine ran each update
    ready: list[int] = []
    clock, k = 0.0, 0
    while k < len(order) or ready:
        if not ready:
            clock = max(clock, available[order[k]])
        while k < len(order) and available[order[k]] <= clock:
            heapq.heappush(ready, order[k])  # forward order: the lowest index first
            k += 1
        i = heapq.heappop(ready)
        busy.append((clock, clock + params[i].numel * rate))
        clock = busy[-1][1]
        finished.append((clock, i))
    uploaded: dict[int, float] = {}
    clock = 0.0
    for done, i in sorted(finished):
        clock = max(clock, done) + params[i].numel * params[i].element_size / profile.h2d_bytes_per_s
        uploaded[i] = clock
    update_start = max(backward, norm_ready) if profile.clipping and offloaded else backward
    touched = sum(p.numel * (32 if profile.clipping else 28) for p in params[:plan.resident])
    device_update = touched / profile.device_bytes_per_s if plan.resident else 0.0
    forward_start = update_start + device_update
    wait = max((uploaded[i] - forward_start - params[i].need_s for i in offloaded), default=0.0)
    wait = max(0.0, wait)
    forward_end = forward_start + profile.forward_s
    # (through the last backward, the device update and the next forward: the threads queueing them)
    contention = HOST_CONTENTION * sum(max(0.0, min(b, forward_end) - a) for a, b in busy)
    total = acc * micro + summing + (update_start - backward) + device_update + wait + contention
    terms = {
        "forward_backward_s": acc * (profile.forward_s + profile.backward_s),
        "recompute_s": acc * recompute,
        "paging_exposed_s": acc * paging,
        "streaming_exposed_s": acc * streaming,
        "hooks_s": acc * hooks,
        "host_summing_s": summing,
        "norm_wait_s": update_start - backward,
        "device_update_s": device_update,
        "weights_wait_s": wait,
        "host_contention_s": contention,
    }
    return total, terms


def bound_seconds(profile: Profile, plan: Plan) -> dict:
    """What a step under `plan` cannot beat, each part alone: the GPU's forwards, backwards and
    recomputes; the host engine's work, the offloaded parameters' updates and the micro-batches
    its threads add into host sums (where their rate was measured); and PCIe, the busier direction of
    the copies the plan makes. Up: the streamed blocks' weights twice a micro-batch (forward, then
    backward), the sums of micro-batches that a kernel reads back to add to, the updated weights
    of the offloaded parameters outside the streamed blocks. Down: each offloaded gradient, every
    micro-batch where the sum is on the host (fp32 from the adding kernel, else as the gradient
    crosses), once a step where it is in VRAM (fp32) or there is no accumulation (2 bytes an
    element: the least a gradient crosses in)."""
    acc = profile.accumulation_steps
    params = profile.params
    gpu = acc * (profile.forward_s + profile.backward_s + recompute_seconds(profile, plan))
    updates = profile.host_s_per_param * sum(p.numel for p in params[plan.resident:])
    adds = (acc - 1) * host_adding_seconds(profile, plan)
    host = updates + adds
    streaming = set(streamed_blocks(profile, plan.streamed)) if plan.streamed else set()
    up = acc * 2 * sum(profile.blocks[j].weight_bytes for j in streaming)
    down = 0
    on_host = adds_on_host(profile, plan)
    for i in range(plan.resident, len(params)):
        p = params[i]
        if p.block not in streaming:
            up += p.element_size * p.numel
        if acc == 1:
            down += 2 * p.numel
        elif _vram_sum(profile, plan, i):
            down += 4 * p.numel
        elif on_host:  # each micro-batch crosses to a landing buffer
            down += 2 * acc * p.numel
        else:  # the first micro-batch lands in the sum, the others are added to it
            down += 4 * acc * p.numel
            up += 4 * (acc - 1) * p.numel
    h2d, d2h = up / profile.h2d_bytes_per_s, down / profile.d2h_bytes_per_s
    copies = max(h2d, d2h)
    return {"gpu_s": gpu, "host_s": host, "host_updates_s": updates, "host_adds_s": adds, "copies_s": copies,
            "h2d_s": h2d, "d2h_s": d2h, "bound_s": max(gpu, host, copies)}


def profile_from(figures: dict) -> Profile:
    """A Profile from its recorded fields (report()["placement"]["profile"], JSON)."""
    def known(cls, recorded: dict) -> dict:  # (a field a later version no longer has is left out)
        names = {f.name for f in fields(cls)}
        return {k: v for k, v in recorded.items() if k in names}

    return Profile(**{**known(Profile, figures), "params": [ParamCost(**known(ParamCost, p)) for p in figures["params"]],
                      "blocks": [BlockCost(**known(BlockCost, b)) for b in figures["blocks"]]})


# -------------------------------------------------------------------------------- planner
def _offload_step(profile: Profile, resident: int, back: bool = True) -> int:
    """How many parameters a residency move takes (at least one, up to STEP_FRACTION of the bytes):
    the last resident ones (`back`: offloading), or the first offloaded ones (keeping them)."""
    params = profile.params
    total = sum(p.numel * p.element_size for p in params) or 1
    taken, k = 0, resident
    while (k > 0 if back else k < len(params)) and taken < STEP_FRACTION * total:
        moved = k - 1 if back else k
        taken += params[moved].numel * params[moved].element_size
        k = moved if back else k + 1
    return abs(resident - k)


def _candidates(profile: Profile, plan: Plan) -> list[tuple[str, Plan]]:
    acc = profile.accumulation_steps
    out = []
    if plan.resident > 0:
        take = _offload_step(profile, plan.resident)
        sums = plan.vram_sums + take if acc > 1 else 0
        out.append((f"offload {take} parameter(s)", replace(plan, resident=plan.resident - take, vram_sums=sums)))
    if acc > 1 and plan.vram_sums > 0:
        end = plan.resident + plan.vram_sums
        take = _offload_step(profile, end) if end > plan.resident else 1
        take = min(take, plan.vram_sums)
        out.append((f"sum {take} parameter(s) on the host", replace(plan, vram_sums=plan.vram_sums - take)))
    if profile.fixed_activations or not profile.blocks:
        return out
    hooked = replace(plan, hooks=True)
    if not plan.hooks:
        out.append(("saved-tensor hooks on", hooked))
    paged = replace(hooked, paged=plan.paged + 1)
    if plan.paged < len(profile.blocks) and _host_holds(profile, paged):  # (host memory holds its copies)
        out.append((f"page block {plan.paged}", paged))
    # Recomputing a block needs no saved-tensor hooks of ours (it is torch's checkpointing): without
    # them it also drops the block's autocast copies, as stock gradient checkpointing does. A
    # block recomputed lightly may be recomputed whole later.
    open_ = [j for j, b in enumerate(profile.blocks) if profile.recompute and not b.checkpointed
             and j not in plan.recomputed and (j >= plan.paged or not plan.hooks)]
    def whole(j: int) -> Plan:
        return replace(plan, recomputed=tuple(sorted(plan.recomputed + (j,))), light=tuple(k for k in plan.light if k != j))

    def lightly(j: int) -> Plan:
        return replace(plan, light=tuple(sorted(plan.light + (j,))))

    for kind, move, options in (("recompute block", whole, open_),
                                ("recompute lightly block", lightly,
                                 [j for j in open_ if j not in plan.light and profile.blocks[j].light_bytes is not None])):
        best = None
        for j in options:
            moved = move(j)
            gain = held_bytes(profile, plan, j) - held_bytes(profile, moved, j)
            added = recompute_seconds(profile, moved) - recompute_seconds(profile, plan)
            if gain > 0 and (best is None or (added / gain, j) < best[0]):
                best = ((added / gain, j), moved)
        if best is not None:
            out.append((f"{kind} {best[0][1]}", best[1]))
    return out


def _last_tier(profile: Profile, plan: Plan) -> list[tuple[str, Plan]]:
    """Streaming the next block's weights: taken only when no other move saves anything."""
    now = device_weight_bytes(profile, plan.streamed)
    for k in range(plan.streamed + 1, streamable(profile) + 1):
        if device_weight_bytes(profile, k) < now:  # (the first blocks streamed are the ones in flight)
            return [(f"stream {k - plan.streamed} more blocks' weights", replace(plan, streamed=k))]
    return []


def _first_streamed_param(profile: Profile, plan: Plan) -> int:
    """How many parameters, the first in forward order, may be resident: those before the first
    streamed block (a streamed block's parameters are offloaded)."""
    streamed = streamed_blocks(profile, plan.streamed)
    inside = [i for i, p in enumerate(profile.params) if p.block in streamed]
    return min(inside, default=len(profile.params))


def share_or_floor(total: int, share: float, floor: int) -> int:
    """`share` of `total`, or `floor` where that is more, but a floor of at most a tenth of `total`."""
    return max(int(share * total), min(floor, total // 10))


def reserve_for(budget: int) -> int:
    """VRAM the planner leaves unplanned for the error of its estimate: 2% of the budget, and at
    least 256 MiB, but never more than a tenth of it."""
    return share_or_floor(budget, RESERVE_FRACTION, MIN_RESERVE)


def plan_placement(profile: Profile, budget: int | None) -> Plan:
    """The fastest placement found whose expected peak, with the reserve, is within `budget`
    (None: no limit): the cheapest saving first, in seconds per GB. `fits` is False when nothing
    is left to move (the plan is then the smallest placement there is)."""
    reserve = reserve_for(budget) if budget is not None else 0
    limit = budget - reserve if budget is not None else float("inf")
    plan = Plan(resident=len(profile.params), hooks=profile.profiled_hooks and profile.fixed_activations,
                paged=profile.profiled_paged if profile.fixed_activations else 0, streamed=profile.streamed)
    plan.resident = _first_streamed_param(profile, plan)
    peak = peak_bytes(profile, plan)
    seconds, _ = step_seconds(profile, plan)
    moves = []
    while peak > limit:
        best = None
        for tier in (_candidates, _last_tier):
            for name, candidate in tier(profile, plan):
                saved = peak - peak_bytes(profile, candidate)
                if saved <= 0:
                    continue
                cost, _ = step_seconds(profile, candidate)
                rank = (max(cost - seconds, 0.0) / saved, cost)
                if best is None or rank < best[0]:
                    best = (rank, name, candidate, saved, cost)
            if best is not None:
                break
        if best is None:
            break
        (per_byte, _), name, plan, saved, cost = best
        moves.append(f"{name}: -{saved / GB:.2f} GB, +{(cost - seconds) * 1e3:.1f} ms")
        peak, seconds = peak - saved, cost
    if peak <= limit:
        plan, peak, seconds = _give_back(profile, plan, limit, peak, seconds, moves)
    seconds, terms = step_seconds(profile, plan)
    return replace(plan, budget=budget, reserve=reserve, expected_peak=peak, expected_step_s=seconds,
                   step_terms=terms, fits=peak <= limit, moves=moves)


def _give_back(profile: Profile, plan: Plan, limit: float, peak: int, seconds: float,
               moves: list[str]) -> tuple[Plan, int, float]:
    """Undoes savings the plan no longer needs: a large saving taken late (the saved-tensor hooks,
    say) can leave room for smaller ones taken before it. While some undo still fits and makes
    the step faster, the one that gains the most is taken."""
    while True:
        undo = []
        if plan.resident < _first_streamed_param(profile, plan):
            take = min(_offload_step(profile, plan.resident, back=False),
                       _first_streamed_param(profile, plan) - plan.resident)
            sums = max(0, plan.vram_sums - take)
            undo.append((f"keep {take} parameter(s) resident", replace(plan, resident=plan.resident + take, vram_sums=sums)))
        for j in plan.recomputed:
            undo.append((f"keep block {j}", replace(plan, recomputed=tuple(k for k in plan.recomputed if k != j))))
        for j in plan.light:
            undo.append((f"keep block {j}", replace(plan, light=tuple(k for k in plan.light if k != j))))
        if plan.paged:
            undo.append((f"keep block {plan.paged - 1} unpaged", replace(plan, paged=plan.paged - 1)))
        best = None
        for name, candidate in undo:
            cost, _ = step_seconds(profile, candidate)
            if cost >= seconds:
                continue
            candidate_peak = peak_bytes(profile, candidate)
            if candidate_peak > limit:
                continue
            if best is None or cost < best[0]:
                best = (cost, name, candidate, candidate_peak)
        if best is None:
            return plan, peak, seconds
        cost, name, plan, candidate_peak = best
        moves.append(f"{name}: +{(candidate_peak - peak) / GB:.2f} GB, {(cost - seconds) * 1e3:.1f} ms")
        peak, seconds = candidate_peak, cost


def smallest_plan(profile: Profile) -> Plan:
    """The placement with the least VRAM: everything offloaded and summed on the host, every
    block recomputed and paged (as far as the activation choices are the planner's)."""
    n = len(profile.blocks)
    if profile.fixed_activations or not n:
        return Plan(resident=0, hooks=profile.profiled_hooks, paged=profile.profiled_paged,
                    streamed=streamable(profile))
    plan = Plan(resident=0, hooks=True, paged=n, streamed=streamable(profile),
                recomputed=tuple(j for j, b in enumerate(profile.blocks)
                                 if b.bytes > b.input_bytes and profile.recompute and not b.checkpointed))
    while not _host_holds(profile, plan):  # as many leading blocks paged as host memory holds
        plan = replace(plan, paged=plan.paged - 1)
    return plan


def describe(plan: Plan, profile: Profile, names: bool = False) -> str:
    """A plan in a few readable lines."""
    params = profile.params
    n = len(params)
    offloaded = params[plan.resident:]
    numel = sum(p.numel for p in params) or 1
    lines = [
        f"placement: {plan.resident} of {n} parameters ({sum(p.numel for p in params[:plan.resident]) / numel:.0%} "
        f"of the elements) keep gradient and AdamW state in VRAM; {len(offloaded)} offloaded to host memory"
        + (f", {plan.vram_sums} of them summing micro-batches in VRAM" if profile.accumulation_steps > 1 else ""),
    ]
    if profile.blocks:
        kinds = block_kinds(plan, profile)
        counts = {k: kinds.count(k) for k in ("kept", "paged", "recomputed", "recomputed lightly",
                                              "recomputed by the model") if kinds.count(k)}
        lines.append(f"activations: {len(kinds)} blocks, " + ", ".join(f"{v} {k}" for k, v in counts.items())
                     + ("; autocast weight copies recast in backward" if plan.hooks else
                        "; no saved-tensor hooks" + (" (recomputing is torch's checkpointing)"
                                                     if plan.recomputed or plan.light else "")))
        own = sum(b.checkpointed for b in profile.blocks)
        if own:
            lines.append(f"checkpointing: the model recomputes {own} blocks itself (its gradient checkpointing); "
                         f"TrainStream leaves them so and recomputes none a second time. Without it (e.g. "
                         f"model.gradient_checkpointing_disable()) the planner recomputes only the blocks the "
                         f"budget needs")
        if plan.hooks and plan.paged:
            room = "" if profile.host_room is None else f" (host memory had room for {profile.host_room / GB:.2f} GB)"
            lines.append(f"host: {paged_host_bytes(profile, plan) / GB:.2f} GB for the paged activations{room}")
        if plan.streamed:
            away = sum(profile.blocks[j].weight_bytes for j in streamed_blocks(profile, plan.streamed))
            lines.append(f"weights: the last {plan.streamed} blocks' ({away / GB:.2f} GB) stream from host memory, "
                         f"at most {streamed_weight_bytes(profile, plan.streamed) / GB:.2f} GB of them in VRAM at a time")
    if plan.budget is not None:
        lines.append(f"VRAM: expected peak {plan.expected_peak / GB:.2f} GB against a budget of "
                     f"{plan.budget / GB:.2f} GB ({plan.reserve / GB:.2f} GB of it kept in reserve)"
                     + ("" if plan.fits else ": does NOT fit"))
    else:
        lines.append(f"VRAM: expected peak {plan.expected_peak / GB:.2f} GB, no budget")
    lines.append(f"profile: forward {profile.forward_s * 1e3:.1f} ms of compute, backward ~{profile.backward_s * 1e3:.1f} ms, "
                 f"host AdamW {profile.host_s_per_param * 1e9:.3f} ns/parameter"
                 + ("" if profile.host_add_s_per_element is None else
                    f", host adds {profile.host_add_s_per_element * 1e9:.3f} ns/element "
                    f"({host_adding_seconds(profile, plan) * 1e3:.1f} ms a micro-batch under this plan)")
                 + f", copies {profile.d2h_bytes_per_s / GB:.1f}/{profile.h2d_bytes_per_s / GB:.1f} GB/s")
    terms = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v * 1e3:.1f} ms"
                      for k, v in plan.step_terms.items() if v > 5e-4)
    lines.append(f"expected step {plan.expected_step_s * 1e3:.1f} ms ({terms})")
    if plan.moves:
        lines.append("savings taken, cheapest first: " + "; ".join(plan.moves[:6])
                     + (f"; ... {len(plan.moves) - 6} more" if len(plan.moves) > 6 else ""))
    if names and offloaded:
        lines.append("offloaded: " + ", ".join(p.name for p in offloaded))
    return "\n".join(lines)
