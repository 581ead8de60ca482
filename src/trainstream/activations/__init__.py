"""Activation paging: saved activations go to host memory during forward, come back before backward.

Saved-tensor hooks see every tensor autograd keeps for backward. Inside the model's repeated
blocks (transformer layers), large activations are copied to pinned host slots on an offload
stream and their device memory is released once the copy is done; in backward, when block k
starts, blocks k-1 ... k-depth are prefetched on a prefetch stream, and each unpack only makes
the compute stream wait for its own copy (an event, no host synchronisation). Paging is a copy,
so training is bit-identical with and without it.

Three things are never paged: parameters (and views of them), which stay in VRAM anyway, the
model's inputs, which the caller holds, and tensors below ``min_bytes``. A storage saved twice is
copied once, and so is a cast that autocast repeats for each matmul reading one activation. The
bf16 copies that autocast makes of fp32 weights are not kept either: backward recasts them from
the weights, which cannot have changed in between because TrainStream updates a weight only
after its gradient is complete. That alone frees 2 bytes per parameter of activation memory
under autocast.

Which blocks to page is decided after a profiling step that pages every block but the last (none
where the first plan has room to spare: trainstream.first_plan.keeps_every_block) and
measures, per block, the bytes saved and the forward time (a block that did not run in it counts
as empty), plus the copy bandwidth:

* ``"auto"``: page the leading blocks whose copies hide behind the forward compute,
* a share in [0, 1]: page that share of the pageable blocks,
* ``vram_budget``: page the blocks whose copies hide, then recompute as many of the others as it
  takes to keep the peak under the budget (non-reentrant checkpointing of the block, whose forward
  runs again in backward: deterministic kernels give the same bits); if that is not enough, or
  with ``recompute=False``, page more, the last block too if need be (the exposed copy time is
  accepted and reported).

The package: plan.py decides which blocks are paged, recomputed or kept (a pure function of the
profile), pager.py runs it (the saved-tensor hooks over the native pager), report.py says what it
did.
"""

from trainstream.activations.pager import ActivationPager
from trainstream.activations.plan import Plan, Profile, find_blocks, plan_paging

__all__ = ["ActivationPager", "Plan", "Profile", "find_blocks", "plan_paging"]
