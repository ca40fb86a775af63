"""The layer graph the planner reasons about: plain data, no torch.

A layer is a group of operations of the captured forward whose value carries the batch dimension
first, or, for a `per_rank` layer, a reduction over the samples of each rank (a loss computed inside
forward), which runs at full width on the rank's own samples, as under DDP. Graph inputs are the
forward's tensor arguments; they and the graph's outputs live on all ranks (width N).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GraphInput:
    """A forward argument: its name, its bytes per sample and whether it requires grad (its moves
    between ranks then run in backward too; a batch's data does not)."""

    name: str
    sample_bytes: int
    requires_grad: bool = False

    def __post_init__(self) -> None:
        if self.sample_bytes < 0:
            raise ValueError(f"input {self.name!r}: sample_bytes must be >= 0, got {self.sample_bytes}")


@dataclass(frozen=True)
class Layer:
    """One planned layer.

    `inputs` names the layers or graph inputs whose values it reads; `sample_bytes` is the size of
    its output per sample; `params`/`param_bytes` count the parameters it owns (a parameter shared
    by several layers is counted once, at its first user); `per_rank` layers run at full width only, as
    do `own_samples` layers: code the capture could not follow (a graph break), run as Python on each
    rank's own samples, as DDP runs it.
    `height` is the fewest rows (height) of any value it splits when it can run on samples split by
    height (convolutions, pooling, BatchNorm, pointwise operations), 0 when it cannot: at most that
    many parts; `halo_bytes` is what a part between two others reads from them per sample, over all
    its windows.
    """

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]
    sample_bytes: int
    params: int = 0
    param_bytes: int = 0
    per_rank: bool = False
    height: int = 0
    halo_bytes: int = 0
    own_samples: bool = False

    def __post_init__(self) -> None:
        if self.op not in ("call_module", "call_function", "call_method"):
            raise ValueError(f"layer {self.name!r}: unknown op {self.op!r}")
        for label, value in (
            ("sample_bytes", self.sample_bytes),
            ("params", self.params),
            ("param_bytes", self.param_bytes),
            ("height", self.height),
            ("halo_bytes", self.halo_bytes),
        ):
            if value < 0:
                raise ValueError(f"layer {self.name!r}: {label} must be >= 0, got {value}")

    @property
    def module(self) -> str | None:
        """The qualified module name for module layers, else None."""
        return self.target if self.op == "call_module" else None


@dataclass(frozen=True)
class Tied:
    """A parameter several layers use (an embedding tied to the output head): `param_bytes`, counted
    in its first user's `Layer.param_bytes`, and its `users` in execution order. Its gradient is
    all-reduced among the ranks of all its users, where it lives (with rank 0)."""

    param: str
    param_bytes: int
    users: tuple[str, ...]


@dataclass(frozen=True)
class LayerGraph:
    """Layers in execution (topological) order, with the graph's inputs and outputs, and the
    parameters shared by several layers (`tied`)."""

    inputs: tuple[GraphInput, ...]
    layers: tuple[Layer, ...]
    outputs: tuple[str, ...]
    tied: tuple[Tied, ...] = ()
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen = {i.name for i in self.inputs}
        index: dict[str, int] = {}
        for position, layer in enumerate(self.layers):
            if layer.name in seen:
                raise ValueError(f"duplicate layer name {layer.name!r}")
            unknown = [name for name in layer.inputs if name not in seen]
            if unknown:
                raise ValueError(
                    f"layer {layer.name!r} reads {unknown} before they are produced: layers must be "
                    "listed in execution order"
                )
            seen.add(layer.name)
            index[layer.name] = position
        missing = [name for name in self.outputs if name not in seen]
        if missing:
            raise ValueError(f"graph outputs {missing} are neither layers nor inputs")
        for tied in self.tied:
            if len(tied.users) < 2 or any(user not in index for user in tied.users):
                raise ValueError(
                    f"tied parameter {tied.param!r}: users {tied.users} are not two or more layers"
                )
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, name: str) -> Layer:
        return self.layers[self._index[name]]

    def position(self, name: str) -> int:
        """Index of a layer in execution order; graph inputs are -1."""
        return self._index.get(name, -1)

    def value_sample_bytes(self, name: str) -> int:
        """Bytes per sample of a layer's output or of a graph input."""
        if name in self._index:
            return self.layers[self._index[name]].sample_bytes
        for graph_input in self.inputs:
            if graph_input.name == name:
                return graph_input.sample_bytes
        raise KeyError(name)

    def consumers(self, name: str) -> list[str]:
        """Layers that read `name`, in execution order (the graph output is not listed)."""
        return [layer.name for layer in self.layers if name in layer.inputs]

    @property
    def fingerprint(self) -> str:
        """A stable hash of the structure (names, ops, targets, edges, sizes)."""
        payload = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    @property
    def structure(self) -> str:
        """A stable hash of what per-sample shapes do not change (names, ops, targets, edges, parameters):
        a plan made for this graph runs the same graph captured at other shapes."""
        data = self.to_dict()
        data["inputs"] = [i["name"] for i in data["inputs"]]
        data["layers"] = [{k: v for k, v in layer.items() if k not in _SIZES} for layer in data["layers"]]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "inputs": [_input_dict(i) for i in self.inputs],
            "layers": [_layer_dict(layer) for layer in self.layers],
            "outputs": list(self.outputs),
        }
        if self.tied:  # graphs without shared parameters keep their files and fingerprints
            data["tied"] = [{**asdict(t), "users": list(t.users)} for t in self.tied]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerGraph:
        return cls(
            inputs=tuple(GraphInput(**i) for i in data["inputs"]),
            layers=tuple(Layer(**{**layer, "inputs": tuple(layer["inputs"])}) for layer in data["layers"]),
            outputs=tuple(data["outputs"]),
            tied=tuple(Tied(**{**t, "users": tuple(t["users"])}) for t in data.get("tied", ())),
        )


_SIZES = ("sample_bytes", "height", "halo_bytes")  # a layer's fields that follow the per-sample shape


def under(path: str, prefix: str) -> bool:
    """Whether module `path` is `prefix` or inside it (``""`` holds every path)."""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _input_dict(graph_input: GraphInput) -> dict[str, Any]:
    data = asdict(graph_input)
    if not graph_input.requires_grad:
        del data["requires_grad"]  # the common case keeps files and fingerprints as they were
    return data


def _layer_dict(layer: Layer) -> dict[str, Any]:
    data = {**asdict(layer), "inputs": list(layer.inputs)}
    for key in ("per_rank", "height", "halo_bytes", "own_samples"):
        if not data[key]:
            del data[key]  # the common case stays out of plan and profile files, and fingerprints
    return data
