"""The paged KV cache: page accounting plus the per-layer key/value storage.

Storage is one tensor per kind shaped [num_layers, num_pages * page_size, kv_heads, head_dim];
page p owns the token slots [p * page_size, (p + 1) * page_size). A request holds a list of
pages (its page table); token i of the request lives in slot
`pages[i // page_size] * page_size + i % page_size`. Pages are contiguous in memory, so a run
of consecutive pages is one contiguous block (what the KV transfer engine coalesces).

Lifecycle of a page: free -> allocated to one request (prefill or decode growth) -> freed when
the request finishes, is aborted or is retracted. `num_free_pages` returning to
`num_total_pages` after every request is the invariant the tests check.
"""

from __future__ import annotations

import torch


class KVPoolExhausted(RuntimeError):
    """Not enough free pages for an allocation."""


class PageAllocator:
    """Free-list of page ids; pure bookkeeping, no tensors."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV pool needs at least one page")
        self.num_total_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps fresh pools dense.
        self._free = list(range(num_pages - 1, -1, -1))
        self._allocated = bytearray(num_pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolExhausted(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._allocated[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._allocated[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._allocated[p] = 0
        self._free.extend(reversed(pages))

    def reset(self) -> None:
        self.__init__(self.num_total_pages)


class PagedKVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_total_pages * self.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
