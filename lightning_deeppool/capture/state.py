"""What a captured forward read besides its arguments: the modules' Python values, checked at every call.

A graph is the forward as it ran at capture, so a Python value the forward read there (a module's
`training` flag, a switch such as `use_extra`, a LightningModule's `global_step` or `current_epoch`)
decided which operations it holds. `record_state` notes every value of a simple type (bool, int, float,
str, None, and tuples of them) that the forward read from one of the captured module's modules;
`ModuleState.current` reads them again, so a call can tell it needs another graph (`ModuleState.changes`
says which values moved). A training-progress counter (`global_step`, `current_epoch`) that forward
only compares (`if self.global_step >= k:`) is checked by those comparisons' outcomes, not its value:
it needs another graph when an outcome changes, not at every step. Forward hooks (their side effects
run only where the module runs) are recorded too: the runtime runs a graph, not the modules' calls.
`watch_strings` hands forward strings that note whether it used them: one it never did (a file name
in a batch dict) does not pick the graph.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

_SIMPLE = (bool, int, float, str, type(None))


# Counters that grow with training: forward compares them with a threshold far more often than it
# computes with them. Other values are checked by value (a comparison followed by a use torch's C code
# makes of the same value, as a size, would not be seen).
_PROGRESS = ("global_step", "current_epoch")
_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "__lt__": operator.lt, "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge,
    "__eq__": operator.eq, "__ne__": operator.ne,
}  # fmt: skip
_SYMBOLS = {"__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">=", "__eq__": "==", "__ne__": "!="}
# The other uses of an int's value from Python.
_INT_USES = (  # noqa: SIM905 (a list of names reads better as words)
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ "
    "__rfloordiv__ __mod__ __rmod__ __divmod__ __rdivmod__ __pow__ __rpow__ __neg__ __pos__ __abs__ "
    "__invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__ __rlshift__ __rshift__ "
    "__rrshift__ __bool__ __int__ __float__ __index__ __hash__ __format__ __str__ __repr__ __round__ "
    "__trunc__ __floor__ __ceil__ __getattribute__ __reduce__ __reduce_ex__"
).split()
Checks = tuple[tuple[str, Any], ...]  # a progress counter's comparisons: (method, the other operand)


def _simple(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


@dataclass(frozen=True)
class ModuleState:
    """The values (`values[i]`, read as `modules[i].<names[i]>`, at module path `paths[i]`) a captured
    forward read, and the forward hooks (module path, hook's name) on `every` module of the captured one
    (its first) that it would have run."""

    every: tuple[nn.Module, ...] = ()
    modules: tuple[nn.Module, ...] = ()
    paths: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()
    hooks: tuple[tuple[str, str], ...] = ()
    checks: tuple[Checks | None, ...] = ()  # per value: a progress counter's comparisons, else None

    def current(self) -> tuple[Any, ...]:
        """The same values read now (cheap: one attribute read each; a progress counter's comparisons'
        outcomes), then the forward hooks now."""
        return (
            *(_read(m, n, c) for m, n, c in zip(self.modules, self.names, self.checks)),
            forward_hooks_of(self.every),
        )

    @property
    def captured(self) -> tuple[Any, ...]:
        """What `current` returned at capture."""
        return (*self.values, self.hooks)

    def unchanged(self) -> bool:
        """Whether every value reads now as it did at capture."""
        return self.current() == self.captured

    def changes(self, now: tuple[Any, ...]) -> list[str]:
        """What differs between capture and `now` (`current`'s result), one line each."""
        found = []
        for path, name, checks, before, after in zip(self.paths, self.names, self.checks, self.values, now):
            if checks is None and before != after:
                found.append(f"{_where(path, name)}: {before!r} -> {after!r}")
            elif checks is not None:
                found += [
                    f"{_where(path, name)} {_SYMBOLS[op]} {other!r}: {was} -> {now_is}"
                    for (op, other), was, now_is in zip(checks, before, after)
                    if was != now_is
                ]
        if now[-1] != self.hooks:
            found.append(f"forward hooks: {list(self.hooks)} -> {list(now[-1])}")
        return found


def call_key(samples: list[tuple[tuple[int, ...], torch.dtype]], state: tuple[Any, ...]) -> int:
    """The digest of per-sample shapes and dtypes and module values that picks a call's graph (what a
    rank's row of a call carries)."""
    return digest(repr(([(tuple(shape), dtype) for shape, dtype in samples], state)))


def digest(text: str) -> int:
    """A 56-bit digest of `text` (fits a row's int64)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big")


def _read(module: nn.Module, name: str, checks: Checks | None) -> Any:
    value = getattr(module, name)
    return value if checks is None else tuple(_COMPARISONS[op](value, other) for op, other in checks)


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def forward_hooks_of(modules: tuple[nn.Module, ...]) -> tuple[tuple[str, str], ...]:
    """Forward hooks registered on `modules` (the captured module's, itself first) and global ones:
    (module path, hook's name). Read at every call, so kept to dict tests where there is none."""
    if not modules or (not torch_module._global_forward_hooks and not any(m._forward_hooks for m in modules)):
        return ()
    found = [("<global>", _name(h)) for h in torch_module._global_forward_hooks.values()]
    for path, m in modules[0].named_modules():
        found += [(path, _name(h)) for h in m._forward_hooks.values()]
    return tuple(found)


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", type(hook).__name__)


@contextmanager
def record_state(module: nn.Module) -> Iterator[list[ModuleState]]:
    """While open, note the simple values read from `module`'s modules (the first read of each);
    on exit, the `ModuleState` of them is the only item of the list yielded."""
    paths = {id(m): path for path, m in module.named_modules()}
    reads: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}
    counters = _Counters()

    def getattribute(self: nn.Module, name: str) -> Any:
        value = object.__getattribute__(self, name)
        key = (id(self), name)
        if id(self) not in paths or not _simple(value) or torch.compiler.is_compiling():
            return value
        if key not in reads:
            reads[key] = (self, name, value)
        return counters.watch(key, value) if name in _PROGRESS and type(value) is int else value

    found: list[ModuleState] = []
    nn.Module.__getattribute__ = getattribute  # type: ignore[method-assign,assignment]
    try:
        yield found
    finally:
        del nn.Module.__getattribute__
    checks = tuple(counters.checks(key) for key in reads)
    found.append(
        ModuleState(
            every=tuple(module.modules()),
            modules=tuple(m for m, _, _ in reads.values()),
            paths=tuple(paths[id(m)] for m, _, _ in reads.values()),
            names=tuple(name for _, name, _ in reads.values()),
            values=tuple(_read(m, name, c) for (m, name, _), c in zip(reads.values(), checks)),
            hooks=forward_hooks_of(tuple(module.modules())),
            checks=checks,
        )
    )


class _Counters:
    """Progress counters handed to forward as ints that note how they are used: compared (with what),
    or otherwise (their value counts). A read whose value forward never used from Python (a size given
    to torch) counts as a use of its value."""

    def __init__(self) -> None:
        self.compared: dict[tuple[int, str], list[tuple[str, Any]]] = {}
        self.by_value: set[tuple[int, str]] = set()
        self.key_of: dict[int, tuple[int, str]] = {}  # id of a handed-out int -> the value it was read as
        self.unused: dict[int, tuple[int, str]] = {}  # the same, until forward uses it
        self.handed: list[int] = []  # keeps handed-out ints alive, so their ids stay theirs

        def noting(name: str) -> Any:
            method = getattr(int, name)
            comparison = name in _COMPARISONS

            def use(value: int, *args: Any) -> Any:
                key = self.key_of[id(value)]
                self.unused.pop(id(value), None)
                if comparison and isinstance(args[0], int | float):
                    self.compared.setdefault(key, []).append((name, args[0]))
                else:
                    self.by_value.add(key)
                return method(value, *args)

            return use

        self.watched = type(
            "WatchedCounter", (int,), {name: noting(name) for name in (*_COMPARISONS, *_INT_USES)}
        )

    def watch(self, key: tuple[int, str], value: int) -> int:
        """`value`, read as `key`, as an int that notes its uses."""
        watched = self.watched(value)
        self.handed.append(watched)
        self.key_of[id(watched)] = self.unused[id(watched)] = key
        return watched

    def checks(self, key: tuple[int, str]) -> Checks | None:
        """The comparisons a counter is checked by, or None where its value counts (or it is no
        counter)."""
        if key not in self.compared or key in self.by_value or key in self.unused.values():
            return None
        return tuple(dict.fromkeys(self.compared[key]))


# What Python does with a string's value: every use of it goes through one of these, or through a
# named method (`__getattribute__`).
_STRING_USES = (  # noqa: SIM905 (a list of 24 names reads better as words)
    "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __hash__ __len__ __getitem__ __iter__ __contains__ "
    "__add__ __radd__ __mul__ __rmul__ __mod__ __rmod__ __format__ __str__ __repr__ __getattribute__ "
    "__reduce__ __reduce_ex__"
).split()


def watch_strings(leaves: list[Any]) -> tuple[list[Any], set[int]]:
    """`leaves` with each string replaced by an equal string that notes, in the set returned, its
    position once its value is used (compared, hashed, formatted, sliced, a method called): a string
    forward never touches (a file name in a batch dict) is not what the graph depends on."""
    touched: set[int] = set()

    def noting(name: str) -> Any:
        # `"prefix" + s` reaches s only through a reflected add, which str itself does not define
        method = getattr(str, name) if name != "__radd__" else lambda self, other: other + str(self)

        def use(self: str, *args: Any, **kwargs: Any) -> Any:
            touched.add(positions[id(self)])
            return method(self, *args, **kwargs)

        return use

    watched = type("WatchedString", (str,), {name: noting(name) for name in _STRING_USES})
    found = [watched(leaf) if isinstance(leaf, str) else leaf for leaf in leaves]
    positions = {id(leaf): i for i, leaf in enumerate(found) if isinstance(leaf, watched)}
    return found, touched
