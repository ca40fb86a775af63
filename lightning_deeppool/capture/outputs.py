"""Containers a forward may return that torch's pytree treats as leaves: dataclasses and mappings of
types it does not know (a Hugging Face `ModelOutput` built directly, say).

Capture registers their types as pytree nodes, so their tensors are split by sample as a dict's are and
the caller gets the same container back. The registration is global, as transformers' own is for its
output classes; a type that cannot be registered stays a leaf, and capture refuses it by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


def register_containers(value: Any) -> None:
    """Register every dataclass and mapping type in `value` that pytree does not know yet."""
    tried: set[type] = set()
    while True:
        fresh = {type(leaf) for leaf in pytree.tree_leaves(value) if _unknown_container(leaf)} - tried
        if not fresh:
            return
        for cls in fresh:
            tried.add(cls)
            _register(cls)


def _unknown_container(leaf: Any) -> bool:
    if isinstance(leaf, torch.Tensor) or type(leaf) in pytree.SUPPORTED_NODES:
        return False
    return isinstance(leaf, Mapping) or (dataclasses.is_dataclass(leaf) and not isinstance(leaf, type))


def _register(cls: type[Any]) -> None:
    if issubclass(cls, Mapping):
        build: Any = cls  # a mapping type built from a dict, as dict subclasses are
        pytree.register_pytree_node(
            cls,
            _mapping_flatten,
            lambda values, keys: build(dict(zip(keys, values))),
            flatten_with_keys_fn=_mapping_flatten_with_keys,
        )
        return
    # Fields it cannot rebuild the instance from leave it a leaf, which capture refuses.
    with contextlib.suppress(TypeError, ValueError):
        pytree.register_dataclass(cls)


def _mapping_flatten(mapping: Mapping[Any, Any]) -> tuple[list[Any], list[Any]]:
    return list(mapping.values()), list(mapping.keys())


def _mapping_flatten_with_keys(mapping: Mapping[Any, Any]) -> tuple[list[tuple[Any, Any]], list[Any]]:
    return [(pytree.MappingKey(key), value) for key, value in mapping.items()], list(mapping.keys())
