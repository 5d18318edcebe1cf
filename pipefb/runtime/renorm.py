"""The in-place row renormalisation of `nn.Embedding(max_norm=...)`, applied by the runtime
on every rank that holds the weight, in the order one process applies it.

[Note: renormalised rows] `nn.Embedding`'s forward with `max_norm` first renormalises, in
place and outside autograd, the weight's rows its ids look up (`torch.embedding_renorm_`),
then looks them up. The write depends only on the weight and the ids, and the lookup's
backward reads only the ids, never the weight. One process applies the renorms of a step's
micro-batches 0..M-1 in that order, each before its own lookup, and the optimizer step
after the last. A second renorm of the same rows is not a no-op in floating point (a row
scaled to `max_norm` may come out an ulp above it), so every renorm must run exactly once,
in that order, on every copy of the weight. Here:

- the layer is the first one (its input is the micro-batch's data, which every rank can
  draw by (seed, step, micro-batch): `pipefb.job.checks` refuses it anywhere else), and
  its `max_norm` is switched off on the rank's copy, so neither autograd, nor the split's
  trace, nor a recompute renormalises (`LayerSplit` traces it with `max_norm` off too);
- before the forward of the step's global micro-batch j, a rank that runs the layer's
  forward applies the renorms of the step's micro-batches it has not applied yet, up to j:
  its own earlier ones, and with groups, the earlier groups' micro-batches (group g starts
  at g*M/G, so its first forward sees what one process's would);
- before the optimizer step of the step, the weight's owner applies the rest up to M-1
  (on a combined rank, the other groups' micro-batches; on a PipeFB backward rank, all of
  them: its forward ran elsewhere), so every group's owner steps the weight one process
  steps, and the PipeFB forward ranks get it with the next version's push;
- the layer is never recomputed (`LayerRunner` keeps its stash, the ids, instead): a
  recompute after a later micro-batch's renorm would look up rows that may differ in the
  last bit from the ones its forward saw.

Async PipeFB is refused at submit: its forward ranks renormalise version k - S while the
owner updates the newest, so no order of one process matches it. PipeDream runs its
forwards on the live weights of the rank that owns them: the renorms apply there, in the
forwards' order (lead forwards of step k + 1 before step k's update, as PipeDream itself
would).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pipefb.job.shapes import renorms_rows
from pipefb.runtime.execs import LayerExec
from pipefb.runtime.inputs import MicroBatches


class Renorms:
    """The renormalising embeddings a rank holds, and how far each step's renorms went."""

    def __init__(self, layers: Mapping[int, nn.Module], data: MicroBatches,
                 microbatches: int) -> None:
        """Switches `max_norm` off on the held renormalising layers (the runtime applies
        it); call before their executors are built.

        Args:
            layers: the rank's layers by index.
            data: the rank's micro-batches (any global one can be drawn).
            microbatches: the step's global micro-batch count (every group's).
        """
        self.norms: dict[int, tuple[nn.Embedding, float, float]] = {}
        for i, layer in layers.items():
            if renorms_rows(layer):
                assert isinstance(layer, nn.Embedding) and layer.max_norm is not None
                self.norms[i] = (layer, float(layer.max_norm), float(layer.norm_type))
                layer.max_norm = None
        self.data, self.microbatches = data, microbatches
        self.execs: Mapping[int, LayerExec] = {}  # told when the weights change; set later
        self.applied: dict[int, int] = {}  # step -> how many global micro-batches applied

    def __contains__(self, layer: int) -> bool:
        return layer in self.norms

    def before_forward(self, step: int, m: int, owner: bool) -> None:
        """Applies step `step`'s renorms up to the rank's micro-batch m (global
        `offset + m`); a rank that owns no such weight forgets the earlier steps."""
        if not self.norms:
            return
        self._apply(step, self.data.offset + m + 1)
        if not owner:
            for old in [s for s in self.applied if s < step]:
                del self.applied[old]

    def before_update(self, step: int) -> None:
        """Applies the rest of step `step`'s renorms, before its optimizer step."""
        if self.norms:
            self._apply(step, self.microbatches)
            self.applied.pop(step, None)

    def _apply(self, step: int, upto: int) -> None:
        """Applies the renorms of global micro-batches `applied[step]` .. `upto` - 1."""
        start = self.applied.get(step, 0)
        for j in range(start, upto):
            ids, _ = self.data.dataset.microbatch(step, j, self.data.size)
            ids = ids.to(self.data.device).contiguous()
            with torch.no_grad():
                for i, (layer, max_norm, norm_type) in self.norms.items():
                    torch.embedding_renorm_(layer.weight, ids, max_norm, norm_type)
                    self.execs[i].weights_changed()
        self.applied[step] = max(start, upto)
