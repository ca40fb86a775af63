"""What each rank brings to a planned forward call, and the checks every rank makes on all of them.

A call is *prepared* on its rank alone (its inputs bound to the captured graph, summarized in a `Row`);
the rows are then exchanged (where the ranks meet in the call agreement, or by an all-gather) and
*checked* the same way on every rank, so a bad call fails on every rank instead of hanging the others.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lightning_deeppool.capture import CapturedGraph, GuardError
from lightning_deeppool.runtime.shared_batch import checksum, shares

OK, GUARD_FAILED, INVALID = 0, 1, 2
SAME_SHAPES_IN_A_STEP = (
    "deeppool moves samples between ranks, so in each step every rank's batch must have the same "
    "per-sample shape (shapes may change from step to step). Pad to a length every rank uses: a fixed "
    "one, or one a collate function or batch sampler picks the same way on every rank for each step"
)


class Row(NamedTuple):
    """What a rank shows the others of its call: its samples, a digest of the per-sample signature,
    whether it can run (`OK`, `GUARD_FAILED`, `INVALID`) and, for a shared batch, the data's checksum."""

    samples: int
    signature: int
    outcome: int
    checksum: int


@dataclass
class Call:
    """A planned forward call on this rank, bound to the captured graph's inputs."""

    batch: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    input_grads: dict[str, bool]
    signature: str
    row: Row
    error: Exception | None = None

    @property
    def samples(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The per-sample shape and dtype of each batch input."""
        return _per_sample(self.batch)


def _per_sample(batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape[1:]), t.dtype) for t in batch.values()]


def prepare(captured: CapturedGraph, args: tuple[Any, ...], kwargs: dict[str, Any], *, shared: bool) -> Call:
    """Bind a call and summarize it. A call that cannot run is marked `INVALID` (its error kept
    for this rank to raise) rather than raised here: the other ranks learn of it from the row."""
    try:
        inputs = captured.bind(args, kwargs)
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
        return Call({}, {}, {}, "", Row(0, 0, INVALID, 0), err)
    signature = repr(
        (
            _per_sample(batch),
            [v.tolist() if isinstance(v, torch.Tensor) else v for v in scalars.values()],
            sorted(input_grads.items()),
        )
    )
    outcome, error = OK, None
    try:
        captured.run_guards(scalars)
    except GuardError as err:
        outcome, error = GUARD_FAILED, err
    digest = int.from_bytes(hashlib.sha1(signature.encode()).digest()[:7], "big")
    data = checksum(list(batch.values())) if shared else 0
    return Call(batch, scalars, input_grads, signature, Row(found.pop(), digest, outcome, data), error)


def new_shape(call: Call, every_row: Sequence[Sequence[int]], captured_samples: list[Any]) -> bool:
    """Whether every rank can make the call, with the same per-sample signature, but at per-sample
    shapes or dtypes other than the captured ones: the same answer on every rank."""
    rows = [Row(*row) for row in every_row]
    agreed = all(row.outcome == OK for row in rows) and len({row.signature for row in rows}) == 1
    return agreed and call.samples != captured_samples


def check(
    call: Call, every_row: Sequence[Sequence[int]], captured_samples: list[Any], *, shared: bool
) -> tuple[int, ...]:
    """Every rank's samples in the call, once every rank's row (as it travelled: its numbers) says the
    call can run (raises the same kind of error on every rank otherwise)."""
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
    if len({row.signature for row in rows}) > 1:
        raise ValueError(
            f"deeppool: ranks called the planned forward with different per-sample shapes, dtypes or "
            f"arguments: {SAME_SHAPES_IN_A_STEP} (this rank's call: {call.signature})"
        )
    if shared and len({(row.samples, row.checksum) for row in rows}) > 1:
        raise ValueError(
            "shared_batch=True needs every rank to read the same global batch, but the ranks' batches "
            f"differ (samples per rank: {[row.samples for row in rows]}); give every rank the same data "
            "in the same order (the strategy's sampler does; a custom sampler must too)"
        )
    if call.samples != captured_samples:
        raise ValueError(
            "the planned forward was captured for inputs of per-sample shapes and dtypes "
            f"{captured_samples}; this step's inputs differ. "
            "The captured graph is specialized to them: pad inputs to a fixed shape"
        )
    return shares(call.row.samples, len(rows)) if shared else tuple(row.samples for row in rows)
