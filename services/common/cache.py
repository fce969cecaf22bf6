"""Sessions' state as rows of batched arrays, and each cache type's batch operations.

A session keeps its state in cache objects (attention keys and values, Mamba conv tails and SSM states, the
conformer's and the codec's streaming buffers, the last codes and random keys). A batched step merges the
sessions' caches into one batch, runs the model over it, and hands each session its rows back; the model files
only do math on the batch they are given. The cache types are here: `FullCache` (every attention key so far, or
with a `Bound` a session's prompt and its last keys), `RingCache` (a sliding window of keys), `MambaCache` (a Mamba
layer's conv tail and SSM state); perception's and the codec's streaming states are plain arrays the engines batch
with `RowSources`. The operations, one per kind of state:

- `RowSources`: any per-session array (B rows -> (1, ...) views and back). `split` hands out rows that are views
  of the batched array; `gather` of the same rows is that array again (no copy), of a run of them a view, else
  one take; `arrange` orders a batch so that its gather copies least.
- `StatePools`: the same for a set of states that the next batch may run over whole, some rows sitting out
  (`rows_of`, `write_rows`), and that a session leaving gets its own copies of (`detach`).
- `GroupedCache` / `LayerGroup`: attention caches (full and ring buffers), whose batched form is one pair of
  arrays written in place each step; `attend_sessions` is their batched write-and-attend.
- `group_by_signature`: which entries of a batch may run as one forward (their state agrees in shape or dtype).

In mlx-lm's terms (its batch caches' merge, extract and filter): `gather` and `LayerGroup(caches)` merge sessions
into a batch; `split`, `StatePool.hand` and a group's rows give each session its rows back; `StatePools.gather`
of some of a pool's sessions takes their rows and `scatter` writes them back; `keep`, `settle` and `drop` filter
what the batches still hold.

On a GPU every small copy is a kernel launch: gathering sixteen sessions' rows one concatenation input each
costs sixteen launches per array, and `batched[i]` with an integer index is a gather of its own; so the rows
stay views of the last batch's arrays, and a batch of the same sessions reuses them as they are.

Attention caches, in more detail: a batched step of S sessions writes each session's new key to its own cache
and attends over each cache, or over the caches stacked (a copy of every key, every step). A `LayerGroup` keeps
the stacked copy instead: the sessions' caches become its rows, and while they step together (all of them, or
some while the others' frames are not due) each step writes the stepping ones' keys with one scatter and
attends once, with no copies. Each cache still advances exactly as its own update would
(`GroupedCache.plan_one`), and its `keys` are its rows, cut to its own buffer size: the array its own update
would hold. A cache that steps any other way takes its rows back (`GroupedCache._own`).

    out = attend_sessions(q, k, v, caches, scale, stack_up_to)   # grouped, stacked or in place, by policy

Re-forming a group for each change of the batch would copy every member's keys on every layer (and the next
full batch would copy them back), which on a GPU cost a batched speech step as much again as the step itself; a
step of some members costs a few small gathers and scatters more than a step of all.
"""

from __future__ import annotations

import abc
import copy
import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from services.common.snapshot import Marks, Snapshot


@functools.lru_cache(maxsize=8)
def take_index(index: tuple[int, ...]) -> mx.array:
    """`index` as an int32 array, made once for the many cache arrays a step gathers in the same order (on a GPU
    every array made from host values is a copy to the device)."""
    return mx.array(index, dtype=mx.int32)


def stack_rows(located: Sequence[tuple[mx.array, int]]) -> mx.array:
    """B rows, each given as (a batched array, its index there) or (a (1, ...) row, 0) -> (B, ...), copying least:
    the rows of one array in its order are that array, a run of them a view, anything else one concatenation of
    the distinct arrays and one take."""
    sources: list[mx.array] = []
    offsets: dict[int, int] = {}
    index = []
    for source, b in located:
        if id(source) not in offsets:
            offsets[id(source)] = sum(a.shape[0] for a in sources)
            sources.append(source)
        index.append(offsets[id(source)] + b)
    stacked = sources[0] if len(sources) == 1 else mx.concatenate(sources, axis=0)
    if index == list(range(stacked.shape[0])):
        return stacked
    if index == list(range(index[0], index[0] + len(index))):  # a run of one batch's rows: a view
        return stacked[index[0] : index[0] + len(index)]
    return stacked[take_index(tuple(index))]


class RowSources:
    """Which batched array each per-session row (a cache, a state, a random key) is a slice of, so the next
    batched step gathers the rows back with one copy per source array and one take, rather than one copy per
    session.

        rows = sources.split(batched)          # (B, ...) -> B rows of (1, ...), remembered
        again = sources.gather(rows)           # the same array, no copy; a run of it a view; else one take
        order = sources.arrange(rows[::-1])    # [2, 1, 0]: the order in which gather copies nothing

    With `squeeze` the rows are (...) rather than (1, ...) (the mel streams' sample buffers, speech's keys). Rows
    are held weakly: once no session holds any row of a batched array, that array is let go (a closed session's
    state does not outlive it here). `keep` forgets the rows a user no longer counts on sooner.
    """

    def __init__(self):
        # id(row) -> (a weak reference to row, batched, index)
        self._rows: dict[int, tuple[weakref.ref, mx.array, int]] = {}

    def split(self, batched: mx.array, squeeze: bool = False) -> list[mx.array]:
        # views, made in one call (half the host time of a slice per row, which a step of 16 sessions on the full
        # encoder makes some 800 times); an integer index (batched[b]) would be a gather, one copy per row
        rows = mx.split(batched, batched.shape[0], axis=0)
        if squeeze:
            rows = [row.squeeze(0) for row in rows]
        for b, row in enumerate(rows):
            self._rows[id(row)] = (weakref.ref(row, functools.partial(self._forget, id(row))), batched, b)
        return rows

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """A row died: drop its entry (and with the batched array's last row, the array)."""
        if self._rows.get(key, (None,))[0] is ref:
            self._rows.pop(key, None)  # a row dropped on another thread may race `keep`: never a KeyError

    def gather(self, rows: list[mx.array], squeeze: bool = False) -> mx.array:
        """rows: B arrays (1, ...) (with squeeze, (...)) of one shape -> (B, ...)."""
        located = []
        for row in rows:
            known = self._rows.get(id(row))
            if known is not None and known[0]() is row:
                located.append((known[1], known[2]))
            else:
                located.append((row[None] if squeeze else row, 0))
        return stack_rows(located)

    def source_of(self, row: mx.array) -> tuple[mx.array, int] | None:
        """The batched array `row` is a view of and its index there, when `split` made it."""
        known = self._rows.get(id(row))
        return (known[1], known[2]) if known is not None and known[0]() is row else None

    def arrange(self, rows: list[mx.array]) -> list[int]:
        """An order of `rows` (positions) that `gather` takes with the fewest copies: the rows of each batched
        array together, in its order (the arrays in the order their first row comes), then the others."""
        sources: dict[int, int] = {}
        known, fresh = [], []
        for position, row in enumerate(rows):
            source = self.source_of(row)
            if source is None:
                fresh.append(position)
            else:
                known.append((sources.setdefault(id(source[0]), len(sources)), source[1], position))
        return [position for *_, position in sorted(known)] + fresh

    def keep(self, held: set[int]) -> None:
        """Forget every row whose id is not in `held` (the rows the live sessions still hold)."""
        # list(...) copies the entries in one step: a row freed on another thread meanwhile runs `_forget`
        self._rows = {k: v for k, v in list(self._rows.items()) if k in held}


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
        self.moves = 0  # times keys it held changed slots (a trim, an append reordering them): no delta spans one
        self._copied_from: tuple[mx.array, mx.array] | None = None  # the arrays `copy` read, until it writes its own

    @property
    def keys(self) -> mx.array | None:
        return self._keys if self.group is None else self.group.rows(self)[0]

    @property
    def values(self) -> mx.array | None:
        return self._values if self.group is None else self.group.rows(self)[1]

    def buffers(self) -> list[mx.array]:
        """The arrays holding its keys and values: its group's pair (shared with the other members) while it is in
        one, else its own. What a step that wrote them evaluates; unlike `keys`, no views are made."""
        if self.group is not None:
            return [self.group.keys, self.group.values]
        return [a for a in (self._keys, self._values) if a is not None]

    def dtypes(self) -> tuple[Any, ...]:
        """Its keys' and values' dtypes (a group's members share theirs), without making views."""
        return tuple(a.dtype for a in self.buffers())

    @property
    def capacity(self) -> int:
        """The size of its key buffer (the keys visible are a prefix of it, or all of it)."""
        if self.group is not None:
            return self._capacity
        return 0 if self._keys is None else self._keys.shape[2]

    def _own(self) -> None:
        self._copied_from = None  # about to write its arrays: no longer what it was copied from
        if self.group is not None:
            self._keys, self._values = self._whole()
            self.group = None

    def _whole(self) -> tuple[mx.array | None, mx.array | None]:
        """Its keys and values at its buffer size: its own arrays, or its group's rows widened to that size."""
        return self.group.rows(self, whole=True) if self.group is not None else (self._keys, self._values)

    def _advance(self, plan: Plan) -> None:
        """Count one key written as `plan` says (a group wrote it)."""
        self.offset += 1
        self._capacity = plan.capacity

    @abc.abstractmethod
    def plan_one(self) -> Plan:
        """Where this cache's next single key goes and what it sees then, as its own update would do it."""

    # ---- snapshots: the keys it holds, its counters (a subclass with more extends both hooks), its last slots ----

    def held(self) -> int:
        """How many keys at the front of its buffer hold state: those written, or the whole of a full ring."""
        return min(self.offset, self.capacity)

    def counters(self) -> dict[str, int]:
        """The scalars that place the next key, for a snapshot; the buffer's size among them, since where it grows
        decides its dtype (a bf16 prompt's buffer grown by float32 keys turns float32, as the reference's does)."""
        return {"offset": self.offset, "capacity": self.capacity}

    def restore_counters(self, snapshot: Snapshot) -> None:
        self.offset = snapshot.int("offset")

    def snapshot(self, since: Marks | None = None) -> dict[str, Any]:
        """Its state: the held keys and values, (B, kv_heads, held, head_dim), read from its group's rows when it
        is in one (the group and the cache are left as they are), and its counters. With `since` (a delta) that
        knows where it stood at the base, the keys and values are `Slices` of the slots written since."""
        from services.common.snapshot import Slices

        state: dict[str, Any] = dict(self.counters())
        keys, values = self.keys, self.values
        mark = None if keys is None else Mark(self.offset, self.moves, keys.dtype)
        base = since.swap(self, mark) if since is not None else None
        if keys is None:
            return state
        n = self.held()
        runs = self._written_since(base, n) if base is not None else None
        if runs is None:
            state["keys"], state["values"] = keys[..., :n, :], values[..., :n, :]
        else:
            for name, array in (("keys", keys), ("values", values)):
                state[name] = Slices(2, n, [(start, array[..., start:stop, :]) for start, stop in runs])
        return state

    def _written_since(self, base: Mark, held: int) -> list[tuple[int, int]] | None:
        """The runs of slots [start, stop) written since `base`, in order (one empty run at the end when none);
        None when the buffer's layout changed since (keys moved, another dtype) or every slot was written."""
        written = self.offset - base.offset
        if base.moves != self.moves or base.dtype != self.keys.dtype or not 0 <= written < held:
            return None
        slots = np.unique(self.slots_of_last(written))  # sorted, each slot once (a ring may pass a slot twice)
        if not slots.size:
            return [(held, held)]
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        return [(int(run[0]), int(run[-1]) + 1) for run in np.split(slots, breaks)]

    @abc.abstractmethod
    def slots_of_last(self, n: int) -> np.ndarray:
        """The slots its last n single keys went to (n below what it holds; its layout unchanged meanwhile)."""

    def copy(self) -> GroupedCache:
        """A cache holding what this one holds, its counters and keys, in array objects of its own (a group
        member's rows read out, the member left in its group): a write of either (in place, by slice) leaves the
        other as it is."""
        keys, values = self._whole()
        other = copy.copy(self)
        other.group, other._row, other._capacity, other._copied_from = None, 0, 0, None
        if keys is not None:
            other._keys, other._values = mx.array(keys), mx.array(values)
            other._copied_from = (keys, values)  # copies of one cache join a group as that cache tiled
        return other

    def copied_from(self) -> tuple[mx.array, mx.array] | None:
        """The keys and values it holds copies of, when `copy` made it and it has written nothing since (joining a
        group is a write: it holds the group's rows after)."""
        return self._copied_from

    def split_rows(self) -> list[GroupedCache]:
        """A cache written for B sessions at once (its own arrays, in no group) as B caches of one row each, with
        its counters: row b is what session b writing its own keys would hold. The rows are views of its arrays
        (a later write of one makes that row's own)."""
        if self.group is not None or self._keys is None:
            raise ValueError("only a cache holding keys of its own splits into rows")
        rows = []
        for keys, values in zip(mx.split(self._keys, self._keys.shape[0]), mx.split(self._values,
                                                                                 self._values.shape[0]), strict=True):
            row = copy.copy(self)
            row._keys, row._values = keys, values
            rows.append(row)
        return rows

    def restore(self, snapshot: Snapshot) -> None:
        """Take the state `snapshot` gave: the held keys in a buffer of the size it had."""
        self.group = None
        self._keys = self._values = self._copied_from = None
        if snapshot.has("keys"):  # read into a buffer of its size, zeros past the held keys as its unwritten keys are
            capacity = snapshot.int("capacity")
            self._keys, self._values = (snapshot.array(name, axis=2, width=capacity) for name in ("keys", "values"))
        self.restore_counters(snapshot)


class Mark(NamedTuple):
    """Where an attention cache stood at a snapshot: what a delta against that snapshot needs of it."""

    offset: int
    moves: int
    dtype: Any


class LayerGroup:
    """One layer's caches of the sessions that step in one batch, as the rows of one pair of arrays: rows
    per * i ... per * (i + 1) - 1 are member i's, each widened with zeros to the longest buffer. A step attends
    over the buffer's first max(visible) keys, those past each member's visible ones masked out."""

    def __init__(self, caches: Sequence[GroupedCache], per: int):
        """Stack the caches (each with keys, all of one dtype; see `can_form`) and make them this group's rows: the
        members of another group in its row order as one piece of its arrays, copies of one cache as that cache
        tiled, each other cache on its own (`_runs`)."""
        self.members = [weakref.ref(cache) for cache in caches]  # a closed session's caches are not kept alive
        self.per = per
        width = max(cache.capacity for cache in caches)
        runs = _runs(caches, per)
        self.keys, self.values = (mx.concatenate([run.rows(which, width) for run in runs], axis=0)
                                  for which in (0, 1))
        self._head_index: mx.array | None = None
        for i, cache in enumerate(caches):
            cache._capacity = cache.capacity
            cache._keys = cache._values = cache._copied_from = None
            cache.group, cache._row = self, i * per

    @classmethod
    def of_batched(cls, cache: GroupedCache, per: int) -> list[GroupedCache]:
        """A cache written for several sessions at once (per rows each, its own arrays, in no group) as those
        sessions' caches, the members of a group whose arrays are its arrays: their next batched step takes them
        as they are, where rows split from it (`split_rows`) would be stacked again piece by piece. Each member
        holds what its rows hold, with the cache's counters."""
        if cache.group is not None or cache._keys is None:
            raise ValueError("only a cache holding keys of its own forms a group of its rows")
        group = cls.__new__(cls)
        members = []
        for _ in range(cache._keys.shape[0] // per):
            member = copy.copy(cache)
            member._capacity, member._keys, member._values, member._copied_from = cache.capacity, None, None, None
            members.append(member)
        group.members, group.per = [weakref.ref(member) for member in members], per
        group.keys, group.values, group._head_index = cache._keys, cache._values, None
        for i, member in enumerate(members):
            member.group, member._row = group, i * per
        return members

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

    def rows(self, cache: GroupedCache, whole: bool = False) -> tuple[mx.array, mx.array]:
        """A member's keys and values: views of its rows, up to its buffer size or the group's width if that is
        less (every key it holds is within it); `whole`: widened with zeros to its buffer size, as its own
        buffer would be."""
        rows = slice(cache._row, cache._row + self.per)
        keys, values = self.keys[rows, :, : cache._capacity], self.values[rows, :, : cache._capacity]
        if whole:
            keys, values = widened(keys, cache._capacity), widened(values, cache._capacity)
        return keys, values

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
        width = group_width(self.keys.shape[2], plans)
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


class _Run(NamedTuple):
    """Consecutive caches of a group being formed that one piece of it can give: `count` rows of `group` from row
    `first` on (members in row order), `count` copies of one cache (`source`), or one cache on its own."""

    cache: GroupedCache
    count: int
    group: LayerGroup | None = None
    first: int = 0
    source: tuple[mx.array, mx.array] | None = None

    def rows(self, which: int, width: int) -> mx.array:
        """Its keys (which 0) or values (1), widened to `width` keys: the caches' rows exactly as each one's own
        keys widened give them (a group's rows past a member's keys are zeros, as widening writes them)."""
        if self.group is not None:
            buffer = (self.group.keys, self.group.values)[which]
            rows = buffer[self.first : self.first + self.count * self.group.per]
            return widened(rows[:, :, :width], width)
        if self.source is not None:
            one = widened(self.source[which], width)
            return one if self.count == 1 else mx.tile(one, (self.count, 1, 1, 1))
        return widened((self.cache.keys, self.cache.values)[which], width)


def _runs(caches: Sequence[GroupedCache], per: int) -> list[_Run]:
    """The caches as runs (`_Run`): members of one group in its row order, copies of one cache, the others alone;
    a group's or a source's rows are then one piece of the new stack, not one piece a cache."""
    runs: list[_Run] = []
    for cache in caches:
        source, last = cache.copied_from(), runs[-1] if runs else None
        if cache.group is not None and cache.group.per == per:
            if last is not None and last.group is cache.group and cache._row == last.first + last.count * per:
                runs[-1] = last._replace(count=last.count + 1)
                continue
            runs.append(_Run(cache, 1, group=cache.group, first=cache._row))
        elif source is not None and source[0].shape[0] == per:
            if last is not None and last.source is not None and last.source[0] is source[0]:
                runs[-1] = last._replace(count=last.count + 1)
                continue
            runs.append(_Run(cache, 1, source=source))
        else:
            runs.append(_Run(cache, 1))
    return runs


def group_width(width: int, plans: Sequence[Plan]) -> int:
    """The key buffer width a group of `width` needs for a step of `plans`: as it is while it holds every key they
    see, else GROUP_GROW keys past the most any of them sees (never past the largest buffer size they plan)."""
    needed = max(plan.visible for plan in plans)
    if needed <= width:
        return width
    return min(max(plan.capacity for plan in plans), -(-needed // GROUP_GROW) * GROUP_GROW)


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


# ---- the cache types ------------------------------------------------------------------------------------

GROW = 256  # attention caches grow in blocks of this many positions, as the reference's caches allocate
# A group's buffers grow in blocks of this many positions, whatever its members' buffer sizes: each block is a new
# buffer of the whole group and a copy (every layer's, for every session of the batch: 6.3 GB at once for the
# speech backbone's 48 sessions in blocks of 256), and a block's slack is memory no key uses. A member's own
# buffer keeps its size (`GROW`), so where a member's dtype changes (a grown buffer's) is as its own update's.
GROUP_GROW = 64


@dataclass(frozen=True)
class Bound:
    """How many keys a `FullCache` holds at most: the session's first `keep` keys (its prompt) for good, then the
    last `window` keys after them in a ring.

    >>> Bound(keep=3, window=4).slot(9)   # keys 0-2 kept; key 9 overwrites key 5's slot, 3 + (9 - 3) % 4
    5
    """

    keep: int
    window: int

    def __post_init__(self) -> None:
        if self.keep < 0 or self.window < 1:
            raise ValueError(f"a cache bound keeps keep >= 0 prompt keys and a window >= 1 of the last keys, "
                             f"got keep={self.keep}, window={self.window}")

    @property
    def size(self) -> int:
        return self.keep + self.window

    def slot(self, offset: int) -> int:
        """Where key number `offset` goes: its own position until the bound, then a ring after the kept keys."""
        return offset if offset < self.size else self.keep + (offset - self.keep) % self.window


def context_bound(keep: int, max_context: int | None) -> Bound | None:
    """The bound of a session whose prompt is `keep` positions, `max_context` positions after it (None or 0:
    unbounded, every key kept)."""
    return Bound(keep, max_context) if max_context else None


class FullCache(GroupedCache):
    """Attention keys and values, every one so far in time order: (B, kv_heads, capacity, head_dim), grown
    GROW positions at a time (the speech backbone's global layers, every attention layer of the language model).

    The buffer takes the dtype of the first keys written (a bf16 prompt prefix keeps later float32 keys in bf16,
    exactly as the reference's cache does).

    With a `Bound` it holds at most bound.size keys: until then exactly as without (the same slots, keys and
    sums); after it each new key overwrites the oldest key past the kept prompt, so a single query attends over
    the prompt and the last `window` keys (in slot order, not time order: the language model's attention has no
    positions, and the speech backbone stores its keys rotated at their absolute offsets). Past the bound keys
    come one at a time."""

    def __init__(self, bound: Bound | None = None) -> None:
        super().__init__()
        self.bound = bound

    def plan(self, n: int) -> Plan:
        """Where n new keys go (slot, the keys visible after them, the buffer size then), without writing them: a
        full buffer grows by a multiple of GROW keys past the keys so far (never past the bound)."""
        offset, capacity = self.offset, self.capacity
        if self.bound is not None and offset + n > self.bound.size:
            if n > 1:
                raise ValueError(f"a bounded attention cache takes one key at a time past its {self.bound.size} "
                                 f"keys (it holds {offset}, {n} came); a longer prompt needs a larger keep")
            size = self.bound.size
            return Plan(self.bound.slot(offset), size, size)
        if offset + n > capacity:
            capacity = offset + (GROW + n - 1) // GROW * GROW
            if self.bound is not None:
                capacity = min(capacity, self.bound.size)
        return Plan(offset, offset + n, capacity)

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._own()
        n = keys.shape[2]
        plan = self.plan(n)
        if self._keys is None or plan.capacity > self._keys.shape[2]:
            b, h, _, d = keys.shape
            grow = plan.capacity - self.offset
            grow_k = mx.zeros((b, h, grow, d), keys.dtype)
            grow_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
            if self._keys is None:
                self._keys, self._values = grow_k, grow_v
            else:
                self._keys = mx.concatenate([self._keys[..., : self.offset, :], grow_k], axis=2)
                self._values = mx.concatenate([self._values[..., : self.offset, :], grow_v], axis=2)
        self._keys[..., plan.slot : plan.slot + n, :] = keys
        self._values[..., plan.slot : plan.slot + n, :] = values
        self.offset += n
        return self._keys[..., : plan.visible, :], self._values[..., : plan.visible, :]

    def plan_one(self) -> Plan:
        """What `update` does with one key."""
        return self.plan(1)

    def slots_of_last(self, n: int) -> np.ndarray:
        """Key j's slot is j, past a bound the ring after the kept keys (`Bound.slot`)."""
        keys = np.arange(self.offset - n, self.offset)
        if self.bound is None:
            return keys
        keep, window = self.bound.keep, self.bound.window
        return np.where(keys < self.bound.size, keys, keep + (keys - keep) % window)

    def counters(self) -> dict[str, int]:
        """With a bound its keep and window too (-1: none), so a restored cache holds and overwrites as it did."""
        keep, window = (self.bound.keep, self.bound.window) if self.bound is not None else (-1, -1)
        return {**super().counters(), "keep": keep, "window": window}

    def restore_counters(self, snapshot: Snapshot) -> None:
        super().restore_counters(snapshot)
        keep, window = snapshot.int("keep"), snapshot.int("window")
        self.bound = Bound(keep, window) if window > 0 else None

    def mask(self, n: int) -> str | None:
        return "causal" if n > 1 else None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


class RingCache(GroupedCache):
    """Sliding-window attention keys and values, the last `window` keys (the speech backbone's local layers): a
    multi-token update appends in time order; single tokens overwrite a ring.

    Mirrors the reference's rotating cache layout exactly (slot order decides the attention sum's order).
    """

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.slot = 0  # next write position in the buffer

    def _in_time_order(self, v: mx.array) -> mx.array:
        if self.slot == v.shape[2]:
            return v
        if self.slot < self.offset:
            return mx.concatenate([v[..., self.slot :, :], v[..., : self.slot, :]], axis=2)
        return v[..., : self.slot, :]

    def _append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._keys is None:
            # its own copies: a view (values sliced from a fused projection) would hold that whole buffer
            self._keys, self._values = mx.contiguous(keys), mx.contiguous(values)
        else:
            self._keys, self._values = self._in_time_order(self._keys), self._in_time_order(self._values)
            self.moves += 1
            drop = max(self._keys.shape[2] - self.window + 1, 0)  # keep window - 1 old keys for each new one
            self._keys = mx.concatenate([self._keys[..., drop:, :], keys], axis=2)
            self._values = mx.concatenate([self._values[..., drop:, :], values], axis=2)
        self.offset += keys.shape[2]
        self.slot = self._keys.shape[2]
        return self._keys, self._values

    def plan_one(self) -> Plan:
        """What a single-key update does: the buffer grows by up to GROW keys until it holds `window`; a buffer
        left longer by a multi-token append drops its oldest keys; the slot wraps at `window`."""
        capacity, slot, trim = self.capacity, self.slot, 0
        if capacity == 0 or (self.offset >= capacity and capacity < self.window):
            capacity += min(GROW, self.window - self.offset)
            slot = self.offset
        if capacity > self.window:  # after a long multi-token append: keep the newest `window` keys
            trim, capacity, slot = capacity - self.window, self.window, self.window
        if slot == self.window:
            slot = 0
        visible = self.offset + 1 if self.offset + 1 < self.window else capacity
        return Plan(slot, visible, capacity, slot + 1, trim)

    def _write_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        plan = self.plan_one()
        grow = plan.capacity + plan.trim - self.capacity
        if grow:
            b, h, _, d = keys.shape
            grow_k = mx.zeros((b, h, grow, d), keys.dtype)
            grow_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
            if self._keys is None:
                self._keys, self._values = grow_k, grow_v
            else:
                self._keys = mx.concatenate([self._keys, grow_k], axis=2)
                self._values = mx.concatenate([self._values, grow_v], axis=2)
        if plan.trim:
            self._keys, self._values = self._keys[..., plan.trim :, :], self._values[..., plan.trim :, :]
            self.moves += 1
        self._keys[..., plan.slot : plan.slot + 1, :] = keys
        self._values[..., plan.slot : plan.slot + 1, :] = values
        self.offset += 1
        self.slot = plan.next_slot
        return self._keys[..., : plan.visible, :], self._values[..., : plan.visible, :]

    def _advance(self, plan: Plan) -> None:
        super()._advance(plan)
        self.slot = plan.next_slot

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "slot": self.slot}

    def slots_of_last(self, n: int) -> np.ndarray:
        """Single keys go to consecutive slots, wrapping at `window`, the last before `slot` (a buffer still
        growing holds key j at slot j, the same)."""
        return (self.slot - n + np.arange(n)) % self.window

    def restore_counters(self, snapshot: Snapshot) -> None:
        super().restore_counters(snapshot)
        self.slot = snapshot.int("slot")

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._own()
        if keys.shape[2] == 1:
            return self._write_one(keys, values)
        return self._append(keys, values)

    def mask(self, n: int) -> str | mx.array | None:
        """Mask for n new queries, taken before the update (a single query sees the whole ring)."""
        if n == 1:
            return None
        offset = min(self.window - 1, self.offset)
        if offset + n <= self.window:
            return "causal"
        rows = mx.arange(offset, offset + n)[:, None]
        cols = mx.arange(offset + n)[None]
        return (rows >= cols) & (rows < cols + self.window)


class PooledState:
    """A state of a few arrays of one row each (`width` of them) that a pool's batched step may hold as rows of
    its stacks: the state is then read as views of those rows only when something reads it (a solo step, a
    snapshot), not made for every session after every batched step. Setting `state` gives it arrays of its own.
    """

    width = 0

    def __init__(self, state: tuple[mx.array | None, ...] | None = None) -> None:
        self._state: tuple[mx.array | None, ...] | None = state or (None,) * self.width
        self._rows: tuple[list[mx.array], int, int] | None = None  # (stacks, first, row) while a pool's
        self._copied_from: tuple[mx.array | None, ...] | None = None  # what `copy` read, until a new state

    @property
    def state(self) -> tuple[mx.array | None, ...]:
        if self._state is None:
            stacks, first, row = self._rows
            self._state = tuple(stack[row : row + 1] for stack in stacks[first : first + self.width])
        return self._state

    @state.setter
    def state(self, state: tuple[mx.array | None, ...]) -> None:
        self._state, self._rows, self._copied_from = tuple(state), None, None

    def take_rows(self, stacks: list[mx.array], first: int, row: int) -> None:
        """Hold row `row` of stacks[first], stacks[first + 1], ... as its state, read when first needed."""
        self._state, self._rows, self._copied_from = None, (stacks, first, row), None

    def copied_from(self) -> tuple[mx.array | None, ...] | None:
        """The arrays `copy` read, while it holds their copies unchanged (copies of one state then stack as that
        state tiled, one copy in all)."""
        return self._copied_from

    def holds_rows(self, stacks: list[mx.array], first: int, row: int) -> bool:
        """Whether its state is still those rows (read or not), nothing having set it since."""
        rows = self._rows
        return rows is not None and rows[0] is stacks and rows[1] == first and rows[2] == row

    def copy(self) -> PooledState:
        """A state holding what this one holds in array objects of its own, outside any pool (remembering the
        arrays it copied, `copied_from`)."""
        other = copy.copy(self)
        source = self.state
        other.state = tuple(None if a is None else mx.array(a) for a in source)
        other._copied_from = source
        return other

    def split_rows(self) -> list[PooledState]:
        """A state computed for B sessions at once (arrays of B rows) as B states of one row each (views)."""
        columns = [None if a is None else mx.split(a, a.shape[0]) for a in self.state]
        count = max(len(c) for c in columns if c is not None)
        rows = []
        for b in range(count):
            row = copy.copy(self)
            row.state = tuple(None if c is None else c[b] for c in columns)
            rows.append(row)
        return rows

    def dtypes(self) -> tuple[Any, ...]:
        """Its arrays' dtypes, without reading held rows."""
        if self._state is None:
            stacks, first, _ = self._rows
            return tuple(stack.dtype for stack in stacks[first : first + self.width])
        return tuple(a.dtype for a in self._state if a is not None)


class MambaCache(PooledState):
    """A Mamba2 layer's state: conv tail (B, K-1, conv_dim) and SSM state (B, H, head_dim, state). A batched
    step stacks `state` with the other sessions' (`StatePools`)."""

    width = 2

    def __init__(self, conv: mx.array | None = None, ssm: mx.array | None = None) -> None:
        super().__init__((conv, ssm))

    @property
    def conv(self) -> mx.array | None:
        return self.state[0]

    @conv.setter
    def conv(self, conv: mx.array | None) -> None:
        self.state = (conv, self.state[1])

    @property
    def ssm(self) -> mx.array | None:
        return self.state[1]

    @ssm.setter
    def ssm(self, ssm: mx.array | None) -> None:
        self.state = (self.state[0], ssm)

    def arrays(self) -> list[mx.array]:
        return [a for a in self.state if a is not None]

    def snapshot(self, since: Marks | None = None) -> dict[str, mx.array]:
        """Its state: its own rows of the conv tail and SSM state (views of a pool's stacks, read as they are).
        Of a fixed size: whole in a delta too (`since` unused)."""
        return {name: a for name, a in (("conv", self.conv), ("ssm", self.ssm)) if a is not None}

    def restore(self, snapshot: Snapshot) -> None:
        self.state = (snapshot.optional("conv", snapshot.array), snapshot.optional("ssm", snapshot.array))


# ---- attention caches: the batched write-and-attend ---------------------------------------------------------

# `stack_up_to` for a device where every cache of a batch should be stacked into a group (no key limit)
STACK_ALL = 1 << 62


def stack_limit(gpu_keys: int) -> int:
    """The most keys a cache may hold to be stacked with the others of a batched step: `gpu_keys` on a GPU,
    where a step is many small kernels and a group saves every session's own write and attention; 0 on the CPU,
    where every cache is read in place (an attention over keys padded to the longest cache costs arithmetic)."""
    return gpu_keys if mx.default_device().type == mx.gpu else 0


def attend_sessions(q: mx.array, k: mx.array, v: mx.array, caches: Sequence[GroupedCache], scale: float,
                    stack_up_to: int = 0, active: Sequence[int] | None = None) -> mx.array:
    """One query position of several sessions over their own caches: q (R, H, 1, Dh), k and v (R, KV, 1, Dh),
    rows r // per of caches[r // per] (per = R // len(caches)) -> (R, H, 1, Dh); each session's k, v are
    written to its own cache, exactly as its own `update` writes them.

    Caches of at most `stack_up_to` keys attend together, over their keys stacked into a `LayerGroup` that their
    next steps (all of them, or some) write in place; every longer cache attends over its keys in place (the
    solo step's attention), its output copied into place. With `active` (increasing row indices of whole
    sessions, `caches` then being theirs) only those rows attend: the others' outputs are zeros."""
    if active is not None:
        at = mx.array(np.asarray(active, np.uint32))
        out = mx.zeros(q.shape, q.dtype)
        out[at] = attend_sessions(q[at], k[at], v[at], caches, scale, stack_up_to)
        return out
    per = q.shape[0] // len(caches)
    held = LayerGroup.holding(caches)
    if held is not None:  # sessions of the last step's group, all, some or one: one write, no copies
        group, index = held
        plans = group.plans(index)
        if plans is not None and all(plan.visible <= stack_up_to for plan in plans):
            return group.step(q, k, v, plans, scale, index)
    elif (plans := _plans_as_group(caches, k, v, stack_up_to)) is not None:  # stacked first, then one write
        return LayerGroup(caches, per).step(q, k, v, plans, scale)
    seen = [cache.update(k[i * per : (i + 1) * per], v[i * per : (i + 1) * per]) for i, cache in enumerate(caches)]
    lengths = [sk.shape[2] for sk, _ in seen]
    stacked = [i for i, n in enumerate(lengths) if n <= stack_up_to] if LayerGroup.can_form(caches) else []
    if len(caches) == 1:  # read in place, as in the solo step
        sk, sv = seen[0]
        return mx.fast.scaled_dot_product_attention(q, sk, sv, scale=scale)
    if len(stacked) == len(caches):  # stacked once into a group, which their next steps write in place
        return LayerGroup(caches, per).attend(q, lengths, scale)
    pieces = {}
    if len(stacked) > 1:
        rows = mx.array([i * per + r for i in stacked for r in range(per)])
        together = _attend_stacked(q[rows], [seen[i] for i in stacked], [caches[i] for i in stacked], per, scale)
        pieces = {i: together[j * per : (j + 1) * per] for j, i in enumerate(stacked)}
    # a single query sees every key of its own cache, as in the solo step: no mask
    return mx.concatenate([pieces[i] if i in pieces else
                           mx.fast.scaled_dot_product_attention(q[i * per : (i + 1) * per], sk, sv, scale=scale)
                           for i, (sk, sv) in enumerate(seen)], axis=0)


def _plans_as_group(caches: Sequence[GroupedCache], k: mx.array, v: mx.array,
                    stack_up_to: int) -> list[Plan] | None:
    """The caches' plans for their next key when, stacked into a group first, they take it as the group's step
    exactly as each one's own update and the stack after it would (stacking changes no plan): every one holds
    keys in the dtype of k and v (a grown buffer keeps it either way), none drops keys (a multi-token append's
    leftovers, which only its own update drops), and every one's view is stacked. None otherwise."""
    if len(caches) < 2 or any(cache.dtypes() != (k.dtype, v.dtype) for cache in caches):
        return None
    plans = [cache.plan_one() for cache in caches]
    return None if any(plan.trim or plan.visible > stack_up_to for plan in plans) else plans


def _attend_stacked(q: mx.array, seen: list[tuple[mx.array, mx.array]], caches: Sequence[GroupedCache], per: int,
                    scale: float) -> mx.array:
    """Attention of q's sessions over their visible keys `seen` stacked, zero-padded to the longest, the
    padding masked -> (len(seen) * per, H, 1, Dh)."""
    lengths = [sk.shape[2] for sk, _ in seen]
    width = max(lengths)
    pairs = list(zip(seen, caches, strict=True))
    keys = mx.concatenate([_padded(sk, cache.keys, width) for (sk, _), cache in pairs], axis=0)
    values = mx.concatenate([_padded(sv, cache.values, width) for (_, sv), cache in pairs], axis=0)
    # a single query sees every key of its own cache, as in the solo step; only the padding is masked
    mask = length_mask(tuple(lengths), per) if min(lengths) < width else None
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def _padded(seen: mx.array, buffer: mx.array, width: int) -> mx.array:
    """A cache's visible keys (a prefix of its buffer) widened to `width` keys: the buffer's next (unused,
    masked) slots when it has them, else zeros."""
    n = seen.shape[2]
    if n == width:
        return seen
    if buffer.shape[2] >= width:
        return buffer[..., :width, :]
    return mx.pad(seen, [(0, 0), (0, 0), (0, width - n), (0, 0)])


# ---- recurrent states: pools of stacked rows ----------------------------------------------------------------


@dataclass
class StatePool:
    """The stacked states a batched step left (B rows each; `stacked` in the order of each session's holders'
    states, [h0.state..., h1.state..., ...]), each session's holders holding their rows of them (`take_rows`).

    While every session still holds exactly those rows (a solo step or a close replaces them), the next batch
    of the same sessions takes the stacks as they are: no per-session concatenation of states each step. A
    batch of some of them (the others' frames not due yet) keeps the pool whole for the next batch of all: it
    steps over every row, the others' rows passed through unchanged, or takes its rows from the stacks and
    writes them back (`StatePools.gather` decides)."""

    sessions: tuple[Any, ...]
    keys: tuple[Hashable, ...]
    holders: tuple[tuple[PooledState, ...], ...]  # holders[b]: session b's
    stacked: list[mx.array]

    def holds(self, b: int) -> bool:
        """Whether session b's states are still this pool's rows."""
        first = 0
        for holder in self.holders[b]:
            if not holder.holds_rows(self.stacked, first, b):
                return False
            first += holder.width
        return True

    def intact(self) -> bool:
        return all(self.holds(b) for b in range(len(self.keys)))

    def views(self, b: int) -> list[mx.array]:
        """Session b's states as its holders read them (views of its rows while it holds them)."""
        return [a for holder in self.holders[b] for a in holder.state]

    def rows_of(self, keys: Sequence[Hashable]) -> list[int] | None:
        """Each key's row in the stacks, when every one is this pool's."""
        where = {key: b for b, key in enumerate(self.keys)}
        rows = [where.get(key) for key in keys]
        return None if None in rows else rows

    def write_rows(self, rows: list[int], states: list[mx.array]) -> None:
        """Put a batch of some of the pool's sessions' new states (len(rows) rows each) into the stacks at `rows`,
        and hand every session its rows of the new stacks (the others' rows are as they were)."""
        at = mx.array(rows)
        for stack, new in zip(self.stacked, states, strict=True):
            stack[at] = new
        self.hand()

    def hand(self) -> None:
        """Give each session's holders their rows of the stacks, to be read as views when read at all (a batch
        of the same sessions next reads none)."""
        for b, holders in enumerate(self.holders):
            first = 0
            for holder in holders:
                holder.take_rows(self.stacked, first, b)
                first += holder.width

    def detach(self, keep: set[Hashable]) -> list[mx.array]:
        """Give each session not in `keep` that still holds its rows its own copies (a view would keep every
        row of the stack alive); returns the copies to evaluate."""
        copies = []
        for b, key in enumerate(self.keys):
            if key in keep or not self.holds(b):
                continue
            for holder in self.holders[b]:
                holder.state = tuple(mx.contiguous(a) for a in holder.state)
                copies += holder.state
        return copies


@dataclass
class Gathered:
    """One batch's states as `StatePools.gather` made them: `members` are the sessions whose rows the forward
    runs over, `rows[i]` is entry i's row, `active` the rows that step (None: all of them)."""

    members: list[Any]
    rows: list[int]
    active: list[int] | None
    states: list[mx.array]
    pool: StatePool | None = None  # the pool whose rows were taken, to be written back
    taken: list[int] | None = None

    def place(self, values: Sequence[mx.array], filler: mx.array) -> list[mx.array]:
        """Entry i's value at row rows[i], `filler` at the rows sitting out."""
        out = [filler] * len(self.members)
        for row, value in zip(self.rows, values, strict=True):
            out[row] = value
        return out


class StatePools:
    """The stacked states of the last batches, by the keys of their sessions, so a batch of the same sessions
    (or of some of them) needs no gather: one mechanism for the recurrent states of any model.

        to_eval = pools.settle(groups)                   # drop the pools these groups break
        batch = pools.gather(sessions)                   # states (B rows each), rows, active
        ...forward over batch.states...
        to_eval += pools.scatter(batch, new_states, holders)

    `holders(session)` gives a session's state holders in stack order, `key(session)` its key. A batch of at
    least `masked_share` of a pool's sessions runs over all the pool's rows (the others' states passed through
    as they are); a smaller share takes its rows and writes them back."""

    def __init__(self, key: Callable[[Any], Hashable], holders: Callable[[Any], Sequence[PooledState]],
                 masked_share: float):
        self.key, self.holders, self.masked_share = key, holders, masked_share
        self.pools: dict[tuple[Hashable, ...], StatePool] = {}

    def __bool__(self) -> bool:
        return bool(self.pools)

    def drop(self, key: Hashable) -> None:
        """Forget every pool of the session `key` (closed): its other sessions' views keep the stack only until
        they step again."""
        for keys in [keys for keys in self.pools if key in keys]:
            del self.pools[keys]

    def settle(self, groups: list[list[Any]]) -> list[mx.array]:
        """Drop every pool that this call's groups do not reuse intact (whole, or one group taking some of its
        sessions), or that a session of theirs has left; returns copies for the sessions they leave behind (to
        evaluate with the batch)."""
        keyed = [[self.key(s) for s in group] for group in groups]
        grouped = {key for keys in keyed for key in keys}
        copies: list[mx.array] = []
        for keys, pool in list(self.pools.items()):
            touching = [group for group in keyed if any(key in keys for key in group)]
            if pool.intact() and (not touching or (len(touching) == 1 and pool.rows_of(touching[0]) is not None)):
                continue
            del self.pools[keys]
            copies += pool.detach(grouped)
        return copies

    def gather(self, sessions: Sequence[Any]) -> Gathered:
        """The states of `sessions` (settled already) as the batch to run: a pool's stacks as they are (all its
        sessions, or enough of them to run over all its rows), its rows of them taken, or the sessions' states
        stacked by the piece (`_state_runs`)."""
        keys = tuple(self.key(s) for s in sessions)
        identity = list(range(len(sessions)))
        pool = self.pools.get(keys)
        if pool is not None:
            return Gathered(list(sessions), identity, None, pool.stacked)
        for pool in self.pools.values():
            rows = pool.rows_of(keys)
            if rows is None:
                continue
            if self.masked_share * len(pool.keys) <= len(sessions):  # over all its rows, the others sitting out
                return Gathered(list(pool.sessions), rows, sorted(rows), pool.stacked)
            at = mx.array(rows)
            return Gathered(list(sessions), identity, None, [mx.take(stack, at, axis=0) for stack in pool.stacked],
                            pool, rows)
        pieces = _state_runs([list(self.holders(s)) for s in sessions])
        return Gathered(list(sessions), identity, None, [parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
                                                         for parts in zip(*pieces, strict=True)])

    def scatter(self, batch: Gathered, states: list[mx.array]) -> list[mx.array]:
        """Hand the batch's new states back to its sessions (writing a taken batch's rows into its pool's
        stacks); returns the arrays to evaluate."""
        if batch.pool is not None:
            batch.pool.write_rows(batch.taken, states)
            return batch.pool.stacked
        members = batch.members
        pool = StatePool(tuple(members), tuple(self.key(s) for s in members),
                         tuple(tuple(self.holders(s)) for s in members), states)
        pool.hand()
        self.pools[pool.keys] = pool
        return states


def _state_runs(holders: list[list[PooledState]]) -> list[list[mx.array]]:
    """Each session's state holders (in stack order) as pieces to stack, a piece per run of sessions: sessions
    holding consecutive rows of one pool's stacks as those rows (one slice a stack), copies of one state as it
    tiled, each other session its own arrays. A session whose holders hold rows of several pools, or whose copies
    are of different states, is a piece of its own."""
    runs: list[tuple[Hashable, list, int, int]] = []  # (kind and identity, stacks or source arrays, first row, count)
    for own in holders:
        kind = _held_rows(own)
        if kind is not None:
            stacks, row = kind
            last = runs[-1] if runs else None
            if last is not None and last[0] == ("rows", id(stacks)) and row == last[2] + last[3]:
                runs[-1] = (*last[:3], last[3] + 1)
            else:
                runs.append((("rows", id(stacks)), stacks, row, 1))
            continue
        sources = [holder.copied_from() for holder in own]
        if all(source is not None for source in sources):
            arrays = [a for source in sources for a in source]
            key = ("copies", *map(id, arrays))
            if runs and runs[-1][0] == key:
                runs[-1] = (*runs[-1][:3], runs[-1][3] + 1)
            else:
                runs.append((key, arrays, 0, 1))
            continue
        runs.append((("own", id(own)), [a for holder in own for a in holder.state], 0, 1))
    pieces = []
    for key, arrays, first, count in runs:
        if key[0] == "rows":
            pieces.append([stack[first : first + count] for stack in arrays])
        else:  # a session's own arrays, or `count` copies of one state
            pieces.append([a if count == 1 else mx.tile(a, (count,) + (1,) * (a.ndim - 1)) for a in arrays])
    return pieces


def _held_rows(holders: list[PooledState]) -> tuple[list[mx.array], int] | None:
    """(stacks, row) when the session's holders hold row `row` of one pool's stacks, in order, as it handed them."""
    first = 0
    held = holders[0]._rows if holders else None
    for holder in holders:
        rows = holder._rows
        if held is None or rows is None or rows[0] is not held[0] or rows[1] != first or rows[2] != held[2]:
            return None
        first += holder.width
    return (held[0], held[2]) if held is not None and first == len(held[0]) else None


# ---- which entries batch together --------------------------------------------------------------------------


def group_by_signature(entries: Sequence[Any], signature: Callable[[Any], Hashable | None],
                       order: Callable[[Any], Any] | None = None) -> tuple[list[list[int]], list[int]]:
    """Split a batch's entries by what must agree for them to run as one forward (their states' dtypes,
    shapes): returns the groups of two or more entries' indices (each sorted by `order` of its entries, so the
    same sessions form the same batch whatever order their steps came in) and the indices of the others (a
    signature None: not batchable; or alone with theirs), in order.

    >>> group_by_signature(["a1", "b1", "a2", "c", "b2"], lambda e: e[0] if e != "c" else None)
    ([[0, 2], [1, 4]], [3])
    """
    groups: dict[Hashable, list[int]] = {}
    solo: list[int] = []
    for i, entry in enumerate(entries):
        key = signature(entry)
        if key is None:
            solo.append(i)
        else:
            groups.setdefault(key, []).append(i)
    batched = []
    for members in groups.values():
        if len(members) == 1:
            solo += members
        else:
            batched.append(sorted(members, key=(lambda i: order(entries[i])) if order else None))
    return batched, sorted(solo)
