"""The check of an installed plan on its first call: every layer's value on rank 0, planned, against
the same layer evaluated on rank 0 alone (which holds every parameter).

Rank 0 holds the first samples of the global batch at every width, so the first samples it holds as
its own input are comparable everywhere (fewer of them where a run at its shapes gives a layer fewer
samples on rank 0 than its own batch has). Models with random operations (dropout) or batch statistics
(BatchNorm in training) cannot be compared this way and are not checked here; capture's own checks
still apply to them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.capture.check import max_difference
from lightning_deeppool.capture.graph import preserved
from lightning_deeppool.capture.values import samples_view

_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-9)}


def first_difference(captured: CapturedGraph, step: Any, inputs: dict[str, Any]) -> str | None:
    """The first layer (in execution order) whose planned value on this rank differs from the
    reference, described; None when all agree or the model cannot be compared."""
    if step is None or captured.stochastic or captured.batch_statistics:
        return None
    batch = {name: inputs[name] for name in captured.batch_inputs}
    scalars = {name: inputs[name] for name in captured.scalar_inputs}
    count = next(iter(batch.values())).shape[0]
    with torch.no_grad(), preserved(captured.module):
        # From the buffers the call found: a layer may update its own as it runs (spectral norm's).
        for name, buffer in captured.module.named_buffers():
            before = step.buffers.get(name) if step.buffers else None
            if before is not None and not torch.equal(before, buffer):
                buffer.copy_(before)
        reference = captured.run_all(batch, count, scalars)
    # A layer split by height holds only its rows here: its values are checked by the layers reading it.
    planned = {
        name: value
        for (name, placement), value in step.values.items()
        if name in captured.code and placement.spatial == 1
    }
    for layer in captured.graph.layers:
        if layer.name not in planned:
            continue
        meta = captured.meta[layer.name]
        pairs = zip(
            pytree.tree_leaves(planned[layer.name]), pytree.tree_leaves(reference[layer.name]), meta.leaves
        )
        for got, want, leaf in pairs:
            if not meta.per_rank:  # the first samples: all of rank 0's, or fewer in a narrow layer
                got = samples_view(got, leaf)[:count]
                want = samples_view(want, leaf)[: got.shape[0]]
            if not _close(got.detach(), want):
                difference = max_difference(got.detach(), want)
                return (
                    f"layer {layer.name!r} differs from its single-device value by up to {difference:.3g}; "
                    "please report this model to lightning-deeppool. Plan it as one layer with "
                    "DeepPoolStrategy(leaf_modules=[...]) to work around it"
                )
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    rtol, atol = _TOLERANCE.get(a.dtype, (1e-2, 1e-2))
    return bool(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol))
