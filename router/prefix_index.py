"""The router's guess at what each prefill instance has in its prefix cache, for the `cache_aware` policy.

A prefill engine keeps the KV of full blocks of earlier prompts (automatic prefix caching) and reuses them for a
prompt that starts with the same tokens. The router cannot see those caches, but it sent every prompt itself: it
records, per instance, the chained hashes of the full blocks of the prompts it sent there, most recent last, and
forgets the oldest beyond the instance's block count (its engine evicts least recently used blocks too). A new
prompt's match on an instance is the number of its leading blocks found there: the prompt tokens that instance
would not have to compute. (SGLang's cache-aware router keeps a radix tree per worker for the same purpose; block
hashes give the same leading-block match with a dict lookup per block.)

It is a guess: another router's requests, a restart or an eviction order that differs make it wrong in either
direction, which costs speed (a prompt recomputed), never correctness (the engine checks its own cache).
"""
from __future__ import annotations

from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `tokens`: block i's hash covers tokens [0, (i + 1) * block_size)."""
    out, h = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, *tokens[start:start + block_size]))
        out.append(h)
    return out


class PrefixIndex:
    """Block hashes one instance holds (as far as this router knows), least recently used first."""

    def __init__(self, capacity_blocks: int):
        assert capacity_blocks >= 1, capacity_blocks
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` are held."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        """Records a prompt's blocks as the most recently used (an engine touches a reused prefix too); drops the
        least recently used beyond capacity_blocks. A prompt's last block counts as used before its first, so its
        tail is forgotten first and what stays is always a prefix (vLLM's block pool frees a request's blocks in
        reverse order for the same reason)."""
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
