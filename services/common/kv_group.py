"""Several sessions' attention caches of one layer as the rows of one pair of arrays, while they step together.

A batched step of S sessions writes each session's new key to its own cache and attends over each cache, or
over the caches stacked (a copy of every key, every step). A `LayerGroup` keeps the stacked copy instead: the
sessions' caches become its rows, and while they step together (all of them, or some while the others' frames
are not due) each step writes the stepping ones' keys with one scatter and attends once, with no copies. Each
cache still advances exactly as its own update would (`GroupedCache.plan_one`), and its `keys` are its rows, cut
to its own buffer size: the array its own update would hold. A cache that steps any other way takes its rows
back (`GroupedCache._own`).

    held = LayerGroup.holding(caches)             # (group, each cache's member index), if all are its members
    if held is not None and (plans := held[0].plans(held[1])) is not None:
        out = held[0].step(q, k, v, plans, scale, held[1])   # one write, one attention; the others untouched
    else:
        ...each cache's own update and attention...
        if LayerGroup.can_form(caches):
            LayerGroup(caches, per)               # their next steps take the path above

Re-forming a group for each change of the batch would copy every member's keys on every layer (and the next
full batch would copy them back), which on a GPU cost a batched speech step as much again as the step itself; a
step of some members costs a few small gathers and scatters more than a step of all.
"""

from __future__ import annotations

import abc
import functools
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np


class Plan(NamedTuple):
    """Where a cache puts one new key, without touching its storage: the slot it is written to, the keys visible
    after it, the buffer size then, and (rings) the slot after it and the oldest keys dropped first."""

    slot: int
    visible: int
    capacity: int
    next_slot: int = 0
    trim: int = 0


class GroupedCache(abc.ABC):
    """A layer's attention cache whose keys and values are its own arrays, or the rows of a `LayerGroup`'s
    arrays while it steps in one batch with the same sessions. `keys` and `values` read either; a subclass's
    `update` writes its own arrays (`_keys`, `_values`) after taking them back from its group (`_own`), and its
    `plan_one` says where one more key would go without touching them."""

    def __init__(self) -> None:
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self.offset = 0
        self.group: LayerGroup | None = None
        self._row = 0  # its first row in the group's arrays
        self._capacity = 0  # its buffer size while in a group

    @property
    def keys(self) -> mx.array | None:
        return self._keys if self.group is None else self.group.rows(self)[0]

    @property
    def values(self) -> mx.array | None:
        return self._values if self.group is None else self.group.rows(self)[1]

    @property
    def capacity(self) -> int:
        """The size of its key buffer (the keys visible are a prefix of it, or all of it)."""
        if self.group is not None:
            return self._capacity
        return 0 if self._keys is None else self._keys.shape[2]

    def _own(self) -> None:
        if self.group is not None:
            self._keys, self._values = self.group.rows(self)
            self.group = None

    def _advance(self, plan: Plan) -> None:
        """Count one key written as `plan` says (a group wrote it)."""
        self.offset += 1
        self._capacity = plan.capacity

    @abc.abstractmethod
    def plan_one(self) -> Plan:
        """Where this cache's next single key goes and what it sees then, as its own update would do it."""


class LayerGroup:
    """One layer's caches of the sessions that step in one batch, as the rows of one pair of arrays: rows
    per * i ... per * (i + 1) - 1 are member i's, each widened with zeros to the longest buffer. A step attends
    over the buffer's first max(visible) keys, those past each member's visible ones masked out."""

    def __init__(self, caches: Sequence[GroupedCache], per: int):
        """Stack the caches (each with keys, all of one dtype; see `can_form`) and make them this group's rows."""
        self.members = [weakref.ref(cache) for cache in caches]  # a closed session's caches are not kept alive
        self.per = per
        width = max(cache.capacity for cache in caches)
        self.keys = mx.concatenate([widened(cache.keys, width) for cache in caches], axis=0)
        self.values = mx.concatenate([widened(cache.values, width) for cache in caches], axis=0)
        self._head_index: mx.array | None = None
        for i, cache in enumerate(caches):
            cache._capacity = cache.capacity
            cache._keys = cache._values = None
            cache.group, cache._row = self, i * per

    @staticmethod
    def can_form(caches: Sequence[GroupedCache]) -> bool:
        """Whether the caches can be stacked: every one holds keys, all of one dtype."""
        dtypes = {None if cache.keys is None else cache.keys.dtype for cache in caches}
        return len(dtypes) == 1 and None not in dtypes

    @staticmethod
    def holding(caches: Sequence[GroupedCache]) -> tuple[LayerGroup, list[int]] | None:
        """The group holding every one of `caches`, with each one's member index (in the order given), when all
        are its members and every member is still in it: a closed or departed member's rows are freed by
        re-forming the group instead."""
        group = caches[0].group
        if group is None or any(cache.group is not group for cache in caches):
            return None
        if any(member() is None or member().group is not group for member in group.members):
            return None
        return group, [cache._row // group.per for cache in caches]

    def rows(self, cache: GroupedCache) -> tuple[mx.array, mx.array]:
        rows = slice(cache._row, cache._row + self.per)
        return self.keys[rows, :, : cache._capacity], self.values[rows, :, : cache._capacity]

    def plans(self, index: Sequence[int] | None = None) -> list[Plan] | None:
        """The plan for one more key of every member (or of the members at `index`); None when one would drop
        keys (a member fresh from a multi-token append), which only its own update does."""
        members = self.members if index is None else [self.members[i] for i in index]
        plans = [member().plan_one() for member in members]
        return None if any(plan.trim for plan in plans) else plans

    def step(self, q: mx.array, k: mx.array, v: mx.array, plans: list[Plan], scale: float,
             index: Sequence[int] | None = None) -> mx.array:
        """Write k, v (R, H, 1, Dh) at each stepping member's slot, advance those members, attend q over the
        buffer. The members stepping are all of them, in order, or those at `index` (q, k, v then hold their
        rows in that order, and `plans` is theirs): the others' keys stay as they are, and their rows of the
        attention, run over the whole buffer, are dropped."""
        width = max(plan.capacity for plan in plans)
        if width > self.keys.shape[2]:
            self.keys, self.values = widened(self.keys, width), widened(self.values, width)
        # in the buffer's dtype, as a member's own slice write stores it (a bf16 prompt keeps bf16 keys)
        k, v = k.astype(self.keys.dtype), v.astype(self.values.dtype)
        slots = tuple(plan.slot for plan in plans)
        if index is None or list(index) == list(range(len(self.members))):
            at = step_index(slots, self.per, "int32")[:, None, None, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, k.shape), k, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, v.shape), v, axis=2)
            for member, plan in zip(self.members, plans, strict=True):
                member()._advance(plan)
            return self.attend(q, [plan.visible for plan in plans], scale)
        rows, source = member_rows(tuple(index), len(self.members), self.per)
        # every axis indexed by an unsigned array (a slice or signed indices would add conversions and a range)
        at_rows, at_slots = rows[:, None], step_index(slots, self.per, "uint32")[:, None]
        heads = self._heads()
        self.keys[at_rows, heads, at_slots] = k[:, :, 0, :]
        self.values[at_rows, heads, at_slots] = v[:, :, 0, :]
        for i, plan in zip(index, plans, strict=True):
            self.members[i]()._advance(plan)
        # the whole buffer attends (a row per group row: the stepping ones' queries, the others' any query), each
        # sitting-out member over the stepping members' widest view, so the attention is as wide as theirs alone
        widest = max(plan.visible for plan in plans)
        visible = [widest] * len(self.members)
        for i, plan in zip(index, plans, strict=True):
            visible[i] = plan.visible
        return self.attend(q[source], visible, scale)[rows]

    def _heads(self) -> mx.array:
        """(1, heads) uint32: the head axis's indices for a scatter into the buffers, made once."""
        if self._head_index is None:
            self._head_index = mx.arange(self.keys.shape[1], dtype=mx.uint32)[None]
        return self._head_index

    def attend(self, q: mx.array, visible: list[int], scale: float) -> mx.array:
        """q (R, H, 1, Dh) over every member's visible keys: the buffer's first max(visible) keys (a view), the
        rest of each member's masked out."""
        width = max(visible)
        keys, values = self.keys, self.values
        if width < keys.shape[2]:
            keys, values = keys[:, :, :width], values[:, :, :width]
        mask = None if min(visible) == width else length_mask(tuple(visible), self.per)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def widened(buffer: mx.array, width: int) -> mx.array:
    """A key buffer (B, H, T, Dh) zero-padded to `width` keys."""
    if buffer.shape[2] == width:
        return buffer
    return mx.pad(buffer, [(0, 0), (0, 0), (0, width - buffer.shape[2]), (0, 0)])


# A step's small index arrays are the same in every layer of one kind (the members stepping, their slots): each is
# built once, not once per layer (on a GPU every array made from host values is a copy to the device).
@functools.lru_cache(maxsize=16)
def step_index(slots: tuple[int, ...], per: int, dtype: str) -> mx.array:
    """(len(slots) * per,) of `dtype`: each member's slot, once for each of its rows."""
    return mx.array(np.repeat(np.asarray(slots, np.int64), per).astype(dtype))


@functools.lru_cache(maxsize=16)
def member_rows(index: tuple[int, ...], members: int, per: int) -> tuple[mx.array, mx.array]:
    """The group rows of the members at `index`, in that order (uint32), and for every group row the position of
    its member's rows among those (int32; 0 for the rows of members not stepping)."""
    rows = (np.asarray(index, np.uint32)[:, None] * per + np.arange(per, dtype=np.uint32)).reshape(-1)
    source = np.zeros(members * per, np.int32)
    source[rows] = np.arange(rows.shape[0], dtype=np.int32)
    return mx.array(rows), mx.array(source)


@functools.lru_cache(maxsize=8)  # the layers of one kind share a step's mask: built once, not per layer
def length_mask(lengths: tuple[int, ...], per: int) -> mx.array:
    """(len(lengths) * per, 1, 1, max(lengths)) bool: row r sees the first lengths[r // per] keys."""
    rows = np.repeat(np.asarray(lengths), per)
    return mx.array(np.arange(max(lengths))[None, :] < rows[:, None])[:, None, None, :]
