"""The first plan: where the parameters live for the profiled steps, from shapes, before any step runs.

The placement planner (placement.py) plans from a measured step, so the steps it measures must
fit both budgets without a plan. wrap() knows the weights and what keeping each parameter's
gradient and AdamW state in VRAM costs, and keeps resident the first parameters (forward order)
whose state fits a share of the budget; a model that fits then never takes host memory for them.
The first forward knows the batch: its tokens, hence the LM head's logits and the loss's fp32
tensors (at their peak in backward, the log-softmax's output, its gradient and the logits'
gradient, with the logits themselves) and an estimate of one block's saved activations. Where
that estimate is over the budget, the first plan offloads the last resident parameters and then
streams the last blocks' weights (as the planner would, cheapest first), and refuses with the
figures where even that cannot fit. The profile then refines the plan (promotion.py).

`plan_first` is pure (tested on CPU with made-up shapes); `read_shapes` reads them off a model
and its first batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainstream import eight_bit
from trainstream.placement import (ParamCost, last_streamable, reserve_for, resident_grad_bytes, state_bytes,
                                   weights_on_device)

# At wrap(), before the batch is known, resident state may take this share of the budget left
# after the weights and the planner's reserve: the rest is the profiled steps' activations.
START_STATE_SHARE = 0.5
# fp32 bytes per logit at the loss's backward peak: the log-softmax's saved output, the gradient
# it gets and the one it gives (the logits themselves, in their dtype, come on top)
LOSS_BYTES_PER_LOGIT = 12
# The profiled steps page every block but the last: one block keeps its activations, and the
# block in backward computes beside it.
PROFILED_BLOCKS_HELD = 2
# ...unless every block's activations kept still leave the estimate under this share of the
# budget less the reserve (the estimate comes from shapes: a wide margin). Then they page none,
# and pin no host memory for slots that a plan with room to spare would never use.
KEEP_ALL_SHARE = 0.8


@dataclass(frozen=True)
class Shapes:
    """What the first plan knows: bytes, no times. Parameters in forward order."""

    resident_bytes: list[int]  # VRAM each parameter's gradient and AdamW state take when resident
    param_blocks: list[int]  # its block: -1 before the blocks, len(blocks) after them
    weight_bytes: int  # every weight and buffer the model keeps on the device, all blocks included
    block_weight_bytes: list[int]
    streamable: list[bool]  # a block without weights that modules outside it use
    stream_depth: int
    head_bytes: int = 0  # the LM head's logits and the loss's tensors at their peak
    block_activation_bytes: int = 0  # an estimate of what one block saves for backward
    tokens: int = 0  # in the batch (0: not known)


@dataclass(frozen=True)
class FirstPlan:
    resident: int  # the first parameters kept in VRAM
    streamed: int  # the last blocks whose weights stream
    peak: int  # the estimate of the profiled steps' peak VRAM under it
    limit: int  # the budget less the planner's reserve
    fits: bool
    tokens: int  # what it was estimated from
    head_bytes: int
    block_activation_bytes: int

    def describe(self) -> str:
        return (f"first plan (from shapes, {self.tokens} tokens a batch): {self.resident} parameters resident, "
                f"{self.streamed} blocks' weights streamed, estimated peak {self.peak / 1e9:.2f} GB of "
                f"{self.limit / 1e9:.2f} GB (LM head and loss {self.head_bytes / 1e9:.2f} GB, a block's "
                f"activations {self.block_activation_bytes / 1e9:.2f} GB)")


def resident_costs(numels: list[int], element_sizes: list[int], accumulation_steps: int,
                   formats: list[str] | None = None) -> list[int]:
    """VRAM each parameter's gradient and AdamW state take when resident (placement.py's terms);
    `formats`: how each keeps its state (eight_bit.state_format; fp32 where not given)."""
    costs = []
    for numel, size, form in zip(numels, element_sizes, formats or ["fp32"] * len(numels)):
        p = ParamCost("", numel, size, 0, 0.0, 0.0, 0, eight_bit.moment_bytes(form != "fp32"), form != "8bit-sr")
        costs.append(state_bytes(p, accumulation_steps) + resident_grad_bytes(p, accumulation_steps))
    return costs


def resident_prefix(costs: list[int], room: float) -> int:
    """How many of the first parameters' costs fit `room` together."""
    total = 0
    for count, cost in enumerate(costs):
        total += cost
        if total > room:
            return count
    return len(costs)


def start_residents(costs: list[int], weight_bytes: int, budget: int) -> int:
    """At wrap(): the first parameters kept resident, their state within START_STATE_SHARE of
    what the budget leaves after the weights and the reserve."""
    room = START_STATE_SHARE * (budget - reserve_for(budget)) - weight_bytes
    return resident_prefix(costs, room) if room > 0 else 0


def plan_first(shapes: Shapes, budget: int, resident: int, streamed: int) -> FirstPlan:
    """The placement for the profiled steps: from wrap()'s (`resident` parameters, `streamed`
    blocks), the last residents offloaded, then more of the last blocks streamed, until the
    estimated peak is within the budget less the reserve."""
    limit = budget - reserve_for(budget)
    n = len(shapes.block_weight_bytes)
    activations = shapes.head_bytes + PROFILED_BLOCKS_HELD * shapes.block_activation_bytes

    def weights(count: int) -> int:
        return weights_on_device(shapes.weight_bytes, shapes.block_weight_bytes, count, shapes.stream_depth)

    def first_streamed_param(count: int) -> int:
        inside = [i for i, b in enumerate(shapes.param_blocks) if n - count <= b < n]
        return min(inside, default=len(shapes.param_blocks))

    can = last_streamable(shapes.streamable)
    while True:
        resident = min(resident, first_streamed_param(streamed))
        room = limit - weights(streamed) - activations
        resident = min(resident, resident_prefix(shapes.resident_bytes, room))
        peak = weights(streamed) + sum(shapes.resident_bytes[:resident]) + activations
        if peak <= limit or streamed >= can:
            return FirstPlan(resident, streamed, peak, limit, peak <= limit, shapes.tokens, shapes.head_bytes,
                             shapes.block_activation_bytes)
        streamed += 1


# Attention that saves no score matrix for backward: with it a block's estimate (its linear layers'
# inputs and outputs) bounds what the block saves; an eager attention's scores grow with the square
# of the sequence, which the estimate does not see.
SCORE_FREE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def attention_saves_no_scores(model: torch.nn.Module) -> bool:
    """Whether the model is known to use SCORE_FREE_ATTENTION (a Hugging Face model's config says)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in SCORE_FREE_ATTENTION


def keeps_every_block(shapes: Shapes, plan: FirstPlan, model: torch.nn.Module) -> bool:
    """Whether the profiled steps may keep every block's activations (KEEP_ALL_SHARE): only where
    the estimate is known to bound them."""
    if not shapes.tokens or not plan.fits or not attention_saves_no_scores(model):
        return False
    others = max(0, len(shapes.block_weight_bytes) - PROFILED_BLOCKS_HELD)
    return plan.peak + others * shapes.block_activation_bytes <= KEEP_ALL_SHARE * plan.limit


# ------------------------------------------------------------------------------ the torch side
def model_bytes(model: torch.nn.Module) -> int:
    """Every weight and buffer of `model`, in bytes."""
    return param_bytes(model) + sum(t.numel() * t.element_size() for t in model.buffers())


def param_bytes(module: torch.nn.Module) -> int:
    """Every weight of `module` (a block, say), in bytes."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def batch_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a batch: the elements of `input_ids`, or of the first integer tensor of two or
    more dimensions among the model's inputs (0 when there is none)."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
            return t.numel()
    return 0


def _activation_size(model: torch.nn.Module, device: torch.device) -> int:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type).itemsize
    return next(model.parameters()).element_size()


def read_shapes(model: torch.nn.Module, blocks: list[torch.nn.Module], costs: list[int], param_blocks: list[int],
                streamable: list[bool], depth: int, weight_bytes: int, tokens: int, device: torch.device) -> Shapes:
    """The first plan's shapes for `model` and a batch of `tokens`. The head is the largest linear
    layer outside the blocks (an LM head's output is the vocabulary); a block's activations are
    estimated as two saved tensors of its activation dtype for each of its linear layers' inputs
    and outputs (a Llama block saves 0.54 GB at 4096 tokens, hidden 2048: this says 0.65 GB)."""
    size = _activation_size(model, device)
    inside = {id(m) for b in blocks for m in b.modules()}
    outputs = [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in inside]
    logits = max(outputs, default=0) * tokens
    features = [sum(m.in_features + m.out_features for m in b.modules() if isinstance(m, torch.nn.Linear))
                for b in blocks]
    return Shapes(resident_bytes=costs, param_blocks=param_blocks, weight_bytes=weight_bytes,
                  block_weight_bytes=[param_bytes(b) for b in blocks],
                  streamable=streamable, stream_depth=depth,
                  head_bytes=logits * (LOSS_BYTES_PER_LOGIT + size),
                  block_activation_bytes=2 * size * tokens * max(features, default=0), tokens=tokens)
