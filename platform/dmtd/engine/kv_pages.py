"""Which KV pages each sequence holds (torch-free): one pool of fixed-size pages, a page list per cache row.

A sequence's position ``t`` lives at offset ``t % page_size`` of page ``table[row][t // page_size]``, for every
layer group alike (the groups fill at different speeds, but a position's page is the same for all). The scheduler
grows a row's list before a step writes past it and shrinks it when the row's sequence ends or is preempted; the
runner copies changed lists into the page-table tensor the kernels read (:meth:`dmtd.engine.kv_cache.KVCache.sync`).

A page is held by the rows whose tables name it (a prompt chunk's pages, shared through the prefix cache, by
several) and may also be cached (published by :mod:`dmtd.engine.prefix_cache`): it goes back to the free list when
no row holds it and it is not cached; a cached page no row holds is dropped when the pool needs pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


@dataclass(slots=True)
class KVPages:
    """The free pages, each row's pages in position order, how many rows hold each page, which are cached."""

    num_pages: int
    page_size: int
    num_rows: int
    free: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # rows holding each page
    cached: set[int] = field(default_factory=set)  # pages the prefix cache publishes
    dirty: set[int] = field(default_factory=set)  # rows whose list changed since the runner last copied it
    num_evictable: int = 0  # cached pages no row holds (free for the taking, their chunks dropped)
    peak_used: int = 0
    # called when too few pages are free: drops one cached chunk no row holds and returns its pages (none: nothing)
    evictor: Callable[[list[int]], list[int]] | None = None

    def __post_init__(self) -> None:
        self.free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.tables = [[] for _ in range(self.num_rows)]
        self.held = [0] * self.num_pages

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        """Pages some row holds."""
        return self.num_pages - len(self.free) - self.num_evictable

    def missing(self, row: int, positions: int) -> int:
        """Pages ``row`` lacks to hold positions ``0 .. positions - 1``."""
        return max(0, pages_for(positions, self.page_size) - len(self.tables[row]))

    def grow(self, row: int, positions: int) -> bool:
        """Give ``row`` the pages for positions ``0 .. positions - 1``, dropping cached chunks no row holds while
        too few are free; False (nothing taken) if even that is not enough."""
        n = self.missing(row, positions)
        if not n:
            return True
        while len(self.free) < n:
            got = self.evictor(self.held) if self.evictor is not None else []
            if not got:
                return False
            self.uncache(got)
        new = [self.free.pop() for _ in range(n)]
        for p in new:
            self.held[p] = 1
        self.tables[row].extend(new)
        self.dirty.add(row)
        self.peak_used = max(self.peak_used, self.num_used)
        return True

    def share(self, row: int, pages: list[int]) -> None:
        """Append ``pages`` (published prompt chunks) to ``row``'s list, held by it too."""
        for p in pages:
            if not self.held[p] and p in self.cached:
                self.num_evictable -= 1
            self.held[p] += 1
        self.tables[row].extend(pages)
        self.dirty.add(row)

    def shrink(self, row: int, positions: int) -> None:
        """``row`` keeps only the pages of positions ``0 .. positions - 1``; the rest it lets go (back to the pool
        where no other row holds them and they are not cached)."""
        keep = pages_for(positions, self.page_size)
        table = self.tables[row]
        if len(table) <= keep:
            return
        for p in reversed(table[keep:]):
            self.held[p] -= 1
            if not self.held[p]:
                if p in self.cached:
                    self.num_evictable += 1
                else:
                    self.free.append(p)
        del table[keep:]
        self.dirty.add(row)

    def cache(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self.cached:
                self.cached.add(p)
                self.num_evictable += not self.held[p]

    def uncache(self, pages: list[int]) -> None:
        for p in pages:
            if p in self.cached:
                self.cached.discard(p)
                if not self.held[p]:
                    self.num_evictable -= 1
                    self.free.append(p)

    def take_dirty(self) -> list[int]:
        rows = sorted(self.dirty)
        self.dirty.clear()
        return rows

    def report(self) -> dict[str, float]:
        return {"kv_pages": self.num_pages, "kv_pages_used": self.num_used, "kv_pages_peak": self.peak_used,
                "kv_pages_cached": len(self.cached), "kv_page_size": self.page_size,
                "kv_utilisation": self.num_used / self.num_pages}
