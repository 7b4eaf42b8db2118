"""A replica's prefix cache: full KV blocks kept by content, shared with running sequences.

Semantics of vLLM's automatic prefix caching (docs/design/prefix_caching.md in vLLM; SGLang's
RadixAttention, arXiv 2312.07104, behaves the same for this purpose):

- A request carries **units**: runs of full KV blocks of its token stream, each with a key
  that identifies the unit's tokens *and everything before them* (a chain hash: the key of a
  unit is its parent's key plus its own tokens' ids, so equal keys mean equal prefixes). A
  Mooncake trace's unit is one of its 512-token hash blocks (32 engine blocks of 16 tokens); a
  synthetic conversation's unit is one engine block. Only full blocks are ever cached: a
  sequence's last partial block is never shared.
- Cached units live in the same paged-KV pool as running sequences. A unit referenced by a
  running sequence is in use; an unreferenced one still holds its blocks but counts as **free
  capacity**: the engine's `free_blocks` includes it, and when the engine takes more blocks than
  are truly free, the least recently released unreferenced units are evicted (LRU), whole.
- Released sequences put their units on the LRU list tail first (vLLM frees a request's blocks
  in reverse order, so a chain's tail is evicted before its root).

**A host-memory tier** (`host_blocks` > 0: `deployment.host_kv_gib`) follows SGLang's HiCache with
its write-back policy (python/sglang/srt/mem_cache/hiradix_cache.py, `HiRadixCache.evict`,
`load_back`, sglang v0.4.10): a unit evicted from HBM is written to host memory, which keeps units in
its own LRU order (its least recently stored or loaded unit goes first when a new one needs room). A
prefix match continues from HBM into the host tier (`match_host`); a host hit is loaded back
(`load`): the unit joins the HBM cache, referenced by the sequence, taking free KV blocks like a fresh
allocation, and its host copy stays (HiCache keeps a loaded node's host value), so evicting it from
HBM again writes nothing new. A unit larger than the whole tier is never stored.

The cache evicts lazily: `reclaim(free_blocks)` evicts until the truly free blocks (free_blocks
minus the unreferenced cached ones) are >= 0. The engine calls it before every cache operation,
so the cache reads exactly as if each allocation had evicted at once (nothing looks at the cache
between an allocation and the next operation). That keeps the engine's block arithmetic, fused
runs included, untouched: they only ever decrement `free_blocks`.

Plain Python dicts: every operation costs O(units touched), never O(cache size) or history.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np


def leading(keys: np.ndarray, held: Mapping[int, int]) -> int:
    """How many leading units of `keys` are in `held` (a tier's units by key)."""
    h = 0
    for k in keys.tolist():
        if k not in held:
            break
        h += 1
    return h


class PrefixCache:
    """Cached units of one replica: key -> (running sequences referencing it, KV blocks), and the
    unreferenced ones in LRU order."""

    def __init__(self, host_blocks: int = 0) -> None:
        self.ref: dict[int, int] = {}  # key -> running sequences referencing the unit
        self.nb: dict[int, int] = {}  # key -> KV blocks the unit holds
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced units, least recently released first
        self.evictable = 0  # KV blocks held by the units in self.lru
        self.evicted_units = 0
        self.evicted_blocks = 0
        # the host tier: key -> KV blocks, least recently stored or loaded first; its capacity in blocks
        self.host: OrderedDict[int, int] = OrderedDict()
        self.host_blocks = host_blocks
        self.host_used = 0  # KV blocks the host tier holds
        self.host_evicted_units = 0  # units dropped from the host tier (gone from both tiers)
        self.host_evicted_blocks = 0

    def reclaim(self, free_blocks: int) -> None:
        """Evict LRU unreferenced units until the truly free blocks (free_blocks - evictable) are >= 0
        (each to the host tier, when there is one)."""
        while self.evictable > free_blocks:
            key, _ = self.lru.popitem(last=False)
            nb = self.nb.pop(key)
            del self.ref[key]
            self.evictable -= nb
            self.evicted_units += 1
            self.evicted_blocks += nb
            if self.host_blocks:
                self.store(key, nb)

    def store(self, key: int, nb: int) -> None:
        """A unit evicted from HBM is written to the host tier (already there: it only becomes the most
        recent), the tier's least recent units dropped to make room."""
        host = self.host
        if key in host:
            host.move_to_end(key)
            return
        if nb > self.host_blocks:
            return  # larger than the whole tier: never stored
        while self.host_used + nb > self.host_blocks:
            _, old = host.popitem(last=False)
            self.host_used -= old
            self.host_evicted_units += 1
            self.host_evicted_blocks += old
        host[key] = nb
        self.host_used += nb

    def match_host(self, keys: np.ndarray) -> int:
        """How many leading units of `keys` the host tier holds (the units after a request's HBM hit)."""
        return leading(keys, self.host)

    def load(self, keys: np.ndarray) -> int:
        """Load these host-tier units back into HBM for a new sequence, which references them (they
        stay in the host tier, now its most recent). Returns the KV blocks they take (from the
        engine's free blocks, like a fresh allocation)."""
        host, ref, nb = self.host, self.ref, self.nb
        taken = 0
        for k in keys.tolist():
            b = host[k]
            host.move_to_end(k)
            assert k not in ref  # (a unit in HBM ends the match before the host tier's)
            ref[k] = 1
            nb[k] = b
            taken += b
        return taken

    def match(self, keys: np.ndarray) -> int:
        """How many leading units of `keys` are cached (referenced or not)."""
        return leading(keys, self.ref)

    def evictable_blocks(self, keys: np.ndarray) -> int:
        """KV blocks of these (cached) units that are unreferenced: taking them uses free capacity."""
        ref, nb = self.ref, self.nb
        return sum(nb[k] for k in keys.tolist() if ref[k] == 0)

    def acquire(self, keys: np.ndarray) -> int:
        """Reference these cached units (a new sequence's hit). Returns the blocks that were
        unreferenced (free capacity until now: the engine takes them from free_blocks)."""
        ref, nb, lru = self.ref, self.nb, self.lru
        taken = 0
        for k in keys.tolist():
            if ref[k] == 0:
                del lru[k]
                taken += nb[k]
            ref[k] += 1
        self.evictable -= taken
        return taken

    def insert(self, keys: np.ndarray, blocks: np.ndarray) -> int:
        """A running sequence's newly computed full units join the cache, referenced by it. A unit
        already cached (computed meanwhile by another sequence) is shared instead and the
        sequence's own copy freed. Returns the change to the engine's free blocks."""
        ref, nb, lru = self.ref, self.nb, self.lru
        delta = 0
        for k, b in zip(keys.tolist(), blocks.tolist(), strict=True):
            r = ref.get(k)
            if r is None:
                ref[k] = 1
                nb[k] = b
                continue
            delta += b  # the sequence's own copy is freed ...
            if r == 0:  # ... and the cached one, free capacity until now, is in use again
                del lru[k]
                self.evictable -= b
                delta -= b
            ref[k] = r + 1
        return delta

    def release(self, keys: np.ndarray) -> int:
        """A sequence leaves (finished or preempted): drop its references, tail first. Returns the
        blocks that became unreferenced (now free capacity)."""
        ref, nb, lru = self.ref, self.nb, self.lru
        freed = 0
        for k in keys[::-1].tolist():
            r = ref[k] - 1
            ref[k] = r
            if r == 0:
                lru[k] = None
                freed += nb[k]
        self.evictable += freed
        return freed

    def cached_blocks(self) -> int:
        """KV blocks held by cached units, referenced or not."""
        return sum(self.nb.values())
