"""What each rank brings to a planned forward call, and the checks every rank makes on all of them.

A call is *prepared* on its rank alone (its inputs bound to the captured graph, summarized in a `Row`);
the rows are then exchanged (where the ranks meet in the call agreement, or by an all-gather) and
*checked* the same way on every rank, so a bad call fails on every rank instead of hanging the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lightning_deeppool.capture import CapturedGraph, GuardError
from lightning_deeppool.capture.state import call_key, digest
from lightning_deeppool.runtime.shared_batch import checksum, shares

OK, GUARD_FAILED, INVALID = 0, 1, 2


class Row(NamedTuple):
    """What a rank shows the others of its call: its samples, the digest of what picks its graph
    (`call_key`: per-sample shapes and dtypes, the module values forward reads, the non-tensor
    arguments it was captured for), the digest of its other arguments (scalars, which inputs require
    grad, and that `state` again), whether it can run (`OK`,
    `GUARD_FAILED`, `INVALID`) and, for a shared batch, the data's checksum."""

    samples: int
    shapes: int
    arguments: int
    outcome: int
    checksum: int


@dataclass
class Call:
    """A planned forward call on this rank, bound to the captured graph's inputs."""

    batch: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    input_grads: dict[str, bool]
    arguments: str  # the scalars' values, which inputs require grad and `state`, as text
    row: Row
    error: Exception | None = None
    # what picks the graph besides shapes: the module values forward reads (`ModuleState.current`) and
    # the non-tensor arguments the graph was captured for (`CallSignature.read`)
    state: tuple[Any, ...] = ()

    @property
    def samples(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The per-sample shape and dtype of each batch input."""
        return _per_sample(self.batch)

    @property
    def signature(self) -> str:
        """What the values a call computes depend on, besides the data."""
        return repr((self.samples, self.arguments))


def _per_sample(batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape[1:]), t.dtype) for t in batch.values()]


def prepare(captured: CapturedGraph, args: tuple[Any, ...], kwargs: dict[str, Any], *, shared: bool) -> Call:
    """Bind a call and summarize it. A call that cannot run is marked `INVALID` (its error kept
    for this rank to raise) rather than raised here: the other ranks learn of it from the row."""
    try:
        inputs, read = captured.split(args, kwargs)
        batch = {name: inputs[name] for name in captured.batch_inputs}
        scalars = {name: inputs[name] for name in captured.scalar_inputs}
        training = torch.is_grad_enabled()
        input_grads = {name: training and batch[name].requires_grad for name in batch}
        if shared and any(input_grads.values()):
            raise ValueError(
                "shared_batch=True: the planned forward's inputs require grad, which a shared batch does not "
                "support; detach them or use shared_batch=False"
            )
        found = {t.shape[0] for t in batch.values()}
        if len(found) > 1:
            raise ValueError(f"batch inputs disagree on the number of samples: {sorted(found)}")
    except (TypeError, ValueError) as err:
        return Call({}, {}, {}, "", Row(0, 0, 0, INVALID, 0), err)
    state = (captured.state.current(), read)
    arguments = repr(
        (
            [v.tolist() if isinstance(v, torch.Tensor) else v for v in scalars.values()],
            sorted(input_grads.items()),
            state,
        )
    )
    outcome, error = OK, None
    try:
        captured.run_guards(scalars)
    except GuardError as err:
        outcome, error = GUARD_FAILED, err
    data = checksum(list(batch.values())) if shared else 0
    row = Row(found.pop(), call_key(_per_sample(batch), state), digest(arguments), outcome, data)
    return Call(batch, scalars, input_grads, arguments, row, error, state)


def without_samples(captured: CapturedGraph, call: Call, device: torch.device) -> Call:
    """This rank's part in a run of the plan at the per-sample shapes `captured` was captured at,
    which its own batch does not have: no samples, the call's arguments."""
    batch = {
        name: torch.empty((0, *shape), dtype=dtype, device=device)
        for name, (shape, dtype) in zip(captured.batch_inputs, captured.samples)
    }
    return Call(batch, call.scalars, call.input_grads, call.arguments, call.row, state=call.state)


def new_shape(call: Call, every_row: Sequence[Sequence[int]], captured: CapturedGraph) -> bool:
    """Whether every rank can make the call, with the same per-sample shapes and arguments, but needs
    another graph than `captured` (other per-sample shapes or dtypes, or other module values read by
    forward): the same answer on every rank."""
    rows = [Row(*row) for row in every_row]
    same = len({(row.shapes, row.arguments) for row in rows}) == 1
    agreed = all(row.outcome == OK for row in rows) and same
    return agreed and call.row.shapes != captured.key


def shape_groups(every_row: Sequence[Sequence[int]]) -> list[list[int]]:
    """The ranks whose batches share per-sample shapes, group by group in the order of their lowest
    rank (one group where every rank's batch has the same shapes)."""
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(every_row):
        groups.setdefault(Row(*row).shapes, []).append(rank)
    return list(groups.values())


def check(call: Call, every_row: Sequence[Sequence[int]], *, shared: bool) -> tuple[int, ...]:
    """Every rank's samples in the call, once every rank's row (as it travelled: its numbers) says the
    call can run (raises the same kind of error on every rank otherwise). The ranks' per-sample
    shapes may differ (`shape_groups`); their other arguments may not."""
    rows = [Row(*row) for row in every_row]
    failed = {
        outcome: [rank for rank, row in enumerate(rows) if row.outcome == outcome]
        for outcome in (GUARD_FAILED, INVALID)
    }
    if call.error is not None:
        raise call.error
    if failed[INVALID]:
        raise RuntimeError(
            f"deeppool: ranks {failed[INVALID]} could not bind their arguments to the planned forward "
            "(their own error says why), so no rank runs it"
        )
    if failed[GUARD_FAILED]:
        raise GuardError(f"deeppool: a captured branch no longer holds on ranks {failed[GUARD_FAILED]}")
    if len({row.arguments for row in rows}) > 1:
        raise ValueError(
            "deeppool: ranks called the planned forward with different arguments (scalar tensors, "
            "inputs that require grad on some ranks only, or values forward reads from the modules, such "
            "as a training flag set on some ranks only); every rank's call must pass the same ones "
            f"(this rank's call: {call.signature})"
        )
    if shared and len({(row.samples, row.shapes, row.checksum) for row in rows}) > 1:
        raise ValueError(
            "shared_batch=True needs every rank to read the same global batch, but the ranks' batches "
            f"differ (samples per rank: {[row.samples for row in rows]}); give every rank the same data "
            "in the same order (the strategy's sampler does; a custom sampler must too)"
        )
    return shares(call.row.samples, len(rows)) if shared else tuple(row.samples for row in rows)
