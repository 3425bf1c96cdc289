"""The held copies of one verified round (`verify_replicas`, issue 9). Pure bookkeeping on ids.

In a verified round a row arrives only once two copies of it, from different workers, agree. A
copy's result is held (the server keeps the gradient) until it is compared; the first two held
copies of a row are compared, one pair per row at a time, and the verdict either lets the row
arrive or releases copies to be computed again. This class records which copies are held, whose
they are, and which rows are in dispute; the scheduler turns that into actions.

A row is any hashable that names one code row (the scheduler uses the row's entries); a copy is
a slot id.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Optional


class VerifiedRows:
    def __init__(self) -> None:
        self._held: dict[Hashable, list[int]] = {}  # row -> held copies, in arrival order
        self._sender: dict[int, str] = {}  # held copy -> the worker whose result it is
        self._kin: dict[int, frozenset] = {}  # held copy -> its sender's kin (fleet.py)
        self._row: dict[int, Hashable] = {}  # held copy -> its row
        self._disputed: set[Hashable] = set()  # rows whose first two copies await a verdict

    def hold(self, row: Hashable, slot: int, sender: str, kin: frozenset = frozenset()) -> None:
        """`sender`'s result for copy `slot` of `row` arrived: keep it for a comparison.
        `kin`: whom the sender may be one party with (its key, invitation, source)."""
        if slot in self._sender:
            raise ValueError(f"copy {slot} is held already")
        self._held.setdefault(row, []).append(slot)
        self._sender[slot] = sender
        self._kin[slot] = frozenset(kin)
        self._row[slot] = row

    def sender(self, slot: int) -> Optional[str]:
        """Whose result for copy `slot` is held; None when none is."""
        return self._sender.get(slot)

    def held(self, row: Hashable) -> list[int]:
        """The held copies of `row`, in arrival order."""
        return list(self._held.get(row, ()))

    def may_take(self, worker: str, row: Hashable, kin: frozenset = frozenset()) -> bool:
        """Whether `worker` (of `kin`) may compute a copy of `row`: a second opinion must come
        from a worker whose result for that row is not held already, nor its kin's (another
        worker of the same key, invitation or source address is no second opinion)."""
        return not any(self._sender[slot] == worker or self._kin[slot] & kin
                       for slot in self._held.get(row, ()))

    def next_pair(self, row: Hashable) -> Optional[tuple[int, int]]:
        """The first two held copies of `row`, now in dispute until a verdict; None while the
        row has fewer than two or a pair of it awaits its verdict already."""
        held = self._held.get(row, ())
        if row in self._disputed or len(held) < 2:
            return None
        self._disputed.add(row)
        return held[0], held[1]

    def row_in_dispute(self, first: int, second: int) -> Optional[Hashable]:
        """The row of the pair (`first`, `second`) if that pair awaits its verdict, else None
        (a verdict comes once, and may come after the round has moved on)."""
        row = self._row.get(first)
        if row is None or row not in self._disputed or self._held[row][:2] != [first, second]:
            return None
        return row

    def end_dispute(self, row: Hashable) -> None:
        self._disputed.discard(row)

    def release(self, slots: Iterable[int]) -> None:
        """Forget the held results of `slots` (found wrong, or undecided): their copies are to
        be computed again."""
        for slot in slots:
            row = self._row.pop(slot)
            del self._sender[slot]
            self._kin.pop(slot, None)
            self._held[row].remove(slot)
