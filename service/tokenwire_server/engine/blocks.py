"""The KV cache's block pool: which request holds which block, and which prompt prefix
each cached block holds. Plain Python, no torch: the scheduler's bookkeeping.

The KV cache is ``num_blocks`` blocks of ``block_size`` tokens in every layer
(``kv.PagedCache``). A request's tokens live in the blocks of its *block table*, in
order: column ``c`` of the request is column ``c % block_size`` of block
``table[c // block_size]``. So the memory committed for KV is the pool and nothing
else, whatever the lengths of the requests and however many there are.

**Admission reserves the worst case.** A request is admitted only when the blocks of
its prompt plus ``max_new_tokens`` are free (or held by nobody, see below), and they
are promised to it: it takes them one at a time as it grows, and it never fails or
waits for lack of KV once admitted. Lack of KV never preempts a running request; the
price is that a request which stops early held a reservation it did not use (vLLM
preempts for KV instead; the trade is written in docs/architecture.md). A request leaves
its blocks early only when a more urgent tenant's request preempts it or its reader
stops reading (it is parked); coming back, it reads its context again, from the prefix
cache where its blocks are still there.

**Automatic prefix caching.** A full block is, once its keys and values are written,
*published* under a key: a hash of its tokens and of
the key of the block before it (so a key names the whole prefix up to the block's
end). A new request looks its prompt's full blocks up key by key and shares the
longest run that is cached: those tokens are not read again (``cached_tokens``).
At least the prompt's last token is always read, so that its logits exist.

A block nobody holds any more stays cached (``idle``) until its memory is needed, and
then the least recently used idle block goes first (its key is dropped). A table is given
back tail first, so a chain's head outlives its tail. Which block a request takes for new
tokens: a block that was used and given back uncached (most recently given back first,
its pages still warm), then a never-used block while fewer than ``fresh_limit`` blocks
have been touched, then the least recently used idle cached block. On a GPU the pool is
committed memory from the start, so the limit is the whole pool and the cache keeps all
it can. On a CPU a never-used block is memory not yet resident, so the limit is the
resident KV the operator allows (``--kv-resident-tokens``): the cache keeps what fits in
it, instead of growing to the whole budget as distinct prompts come and go, and instead
of evicting from the first request on.

Every full block a request writes is published, its generated tokens' as well as its
prompt's (as vLLM does): a stream resumed on the same replica, or a preempted or parked
row coming back, finds all it had written and reads only its last partial block.
Cached blocks are never written: a request writes only past its shared prefix, in
blocks of its own.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Sequence

BLOCK_SIZE = 16


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks hold ``tokens`` tokens."""
    return -(-max(tokens, 0) // block_size)


def next_key(previous: bytes, block: Sequence[int]) -> bytes:
    """The key of a full block of tokens after the block keyed ``previous`` (``b""``: the first)."""
    return hashlib.blake2b(previous + array.array("q", block).tobytes(), digest_size=16).digest()


def prefix_keys(tokens: Sequence[int], block_size: int = BLOCK_SIZE, root: bytes = b"") -> list[bytes]:
    """The key of every full block of ``tokens``: each hashes the block's tokens and the
    key before it (BLAKE2b, 128 bits), so equal keys mean equal prefixes; the first hashes
    ``root`` (a LoRA adapter's: equal keys then also mean the same adapter)."""
    keys: list[bytes] = []
    key = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = next_key(key, tokens[start : start + block_size])
        keys.append(key)
    return keys


@dataclasses.dataclass
class Lease:
    """One request's blocks: those it holds, in table order, and how many more it is promised."""

    blocks: list[int]
    promised: int
    cached_tokens: int  # tokens of the prompt found in the cache (its first ``len(shared)`` blocks)


class BlockPool:
    """``num_blocks`` blocks: held (counted per holder), cached and idle, or never used."""

    def __init__(
        self, num_blocks: int, block_size: int = BLOCK_SIZE, prefix_cache: bool = True, fresh_limit: int | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        # Blocks that may be touched before an idle cached block is reused for new tokens
        # (None: all of them, a GPU's committed pool; on a CPU, the resident KV allowed).
        self.fresh_limit = num_blocks if fresh_limit is None else max(0, min(fresh_limit, num_blocks))
        # Never used: blocks ``touched`` and up, taken in order (a count, not a list: a GPU's pool for a
        # small model can be tens of millions of blocks).
        self.touched = 0  # blocks ever handed out (on a CPU: the KV pages that may be resident)
        self._free: list[int] = []  # used, given back uncached; taken from the end (warmest first)
        self._holders = array.array("i", [0]) * num_blocks  # 4 bytes a block
        self._held = 0  # blocks with at least one holder (kept, not summed: the metrics read it per scrape)
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by nobody; LRU first
        self._promised = 0  # blocks promised to admitted requests and not yet taken
        self.hit_tokens = 0  # prompt tokens found in the cache, ever

    # -- what is left --------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks a new request may still be promised."""
        return self.num_blocks - self.touched + len(self._free) + len(self._idle) - self._promised

    @property
    def held(self) -> int:
        """Blocks held by at least one request."""
        return self._held

    @property
    def cached(self) -> int:
        return len(self._block_of)

    def tokens_committed(self) -> int:
        """Tokens' worth of blocks held or promised (the reservation the metrics show)."""
        return (self.held + self._promised) * self.block_size

    # -- admission and growth --------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest cached run of ``keys`` from the start."""
        found: list[int] = []
        if not self.prefix_cache:
            return found
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def lease(self, total_tokens: int, prompt_keys: Sequence[bytes], prompt_len: int) -> Lease | None:
        """Reserve a request's worst case (``total_tokens``), sharing its prompt's cached
        prefix; None when it does not fit now. ``prompt_keys``: its prompt's full blocks'
        keys (``prefix_keys``); only blocks before the prompt's last token are shared."""
        shareable = max(0, (prompt_len - 1) // self.block_size)
        shared = self.lookup(prompt_keys[:shareable])
        need = blocks_for(total_tokens, self.block_size) - len(shared)
        waking = sum(1 for block in shared if self._holders[block] == 0)  # idle blocks leave the evictable set
        if need + waking > self.available:
            return None
        for block in shared:
            self._hold(block)
        self._promised += need
        cached_tokens = len(shared) * self.block_size
        self.hit_tokens += cached_tokens
        return Lease(blocks=list(shared), promised=need, cached_tokens=cached_tokens)

    def fits_ever(self, total_tokens: int) -> bool:
        """Whether a request of ``total_tokens`` could be admitted into an empty pool."""
        return blocks_for(total_tokens, self.block_size) <= self.num_blocks

    def grow(self, lease: Lease, tokens: int) -> None:
        """Give ``lease`` blocks until they hold ``tokens`` tokens (from its promise)."""
        while len(lease.blocks) * self.block_size < tokens:
            if lease.promised <= 0:
                raise RuntimeError(f"a request grew past its reservation ({tokens} tokens)")
            lease.promised -= 1
            self._promised -= 1
            block = self._take()
            self._holders[block] = 1
            self._held += 1
            lease.blocks.append(block)

    def publish(self, lease: Lease, index: int, key: bytes) -> None:
        """Block ``index`` of ``lease`` is full and written (prompt tokens, or those of a request set
        aside to be read again): cache it under ``key``."""
        if not self.prefix_cache:
            return
        block = lease.blocks[index]
        if key in self._block_of or block in self._key_of:
            return  # the same prefix was cached by another request first (or this block already is)
        self._block_of[key] = block
        self._key_of[block] = key

    def give_back(self, lease: Lease) -> None:
        """The request has left: its blocks go idle (cached) or unused, its promise is void.

        NOTE: tail first, so a chain's head is the most recently idle of its blocks and is
        evicted last: a lookup walks a chain from its head, and losing the head would lose the
        whole chain (vLLM frees a table in reverse for the same reason)."""
        for block in reversed(lease.blocks):
            self._holders[block] -= 1
            if self._holders[block] > 0:
                continue
            self._held -= 1
            if block in self._key_of:
                self._idle[block] = None
                self._idle.move_to_end(block)
            else:
                self._free.append(block)
        lease.blocks = []
        self._promised -= lease.promised
        lease.promised = 0

    # -- internals -------------------------------------------------------------------

    def _hold(self, block: int) -> None:
        if self._holders[block] == 0:
            self._idle.pop(block, None)
            self._held += 1
        self._holders[block] += 1

    def _take(self) -> int:
        """A block for new tokens: a warm free one, then a never-used one while fewer than
        ``fresh_limit`` blocks have been touched, then the least recently used idle one."""
        if self._free:
            return self._free.pop()
        if self.touched < self.num_blocks and (self.touched < self.fresh_limit or not self._idle):
            self.touched += 1
            return self.touched - 1
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
