"""Checkpoint tensor names read as this backend's: the two ways the model files rename them."""

from __future__ import annotations

from collections.abc import Iterable


def prefix_renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """`name` with its first prefix found among `renames` (theirs, ours) replaced; as it is when none is."""
    for theirs, ours in renames:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def parts_renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """`name` with every occurrence of each of `renames`' parts (theirs, ours) replaced, in order."""
    for theirs, ours in renames:
        name = name.replace(theirs, ours)
    return name
