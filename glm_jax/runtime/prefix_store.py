"""Host-RAM copies of K/V the scheduler's rows no longer hold (the prefix cache beyond the rows).

The rows are the first level of the prefix cache (``Scheduler._match``): a finished request's row keeps its
prompt + output K/V until another request takes the row.  Before a row is rewritten with a prompt that does not
continue it, the positions it held are copied here (one entry: the token sequence and, per layer, its K/V at
positions 0..n-1, host numpy); a later request whose prompt starts with an entry's tokens longer than any row's
gets those positions written back into its row and prefills only the rest -- llama-server's ``--cache-ram``.

Entries are least-recently-used first out, bounded by ``max_bytes`` (``--prefix_store_mb``).  An entry is a
function of its tokens alone (K/V at a position depends on the tokens before it, bitwise the same in every row and
at every batch width: the scheduler's batch invariance), so it stays valid when the batch cache is replaced or
grown; ``clear()`` drops everything (the warm-up's junk prompts, a change of weights).  Each entry carries the salt
of the request that left it (``Request.salt``: the server's tenant): a lookup matches entries of its own salt only.
"""

from __future__ import annotations

import collections
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .runner import bucket

MIN_TOKENS = 16          # shorter sequences are not worth a copy (a row holds them, or they prefill in one step)


def common_prefix(a, b, limit: int) -> int:
    n = min(len(a), len(b), limit)
    m = 0
    while m < n and a[m] == b[m]:
        m += 1
    return m


class PrefixStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.entries = collections.OrderedDict()    # id -> (tokens tuple, [{key: np [n, ...]} per layer], nbytes)
        self.salts = {}                             # id -> the salt it was saved under
        self.bytes = 0
        self._next = 0
        self.counters = collections.Counter()       # saved / restored / evicted entries, restored tokens

    def __len__(self):
        return len(self.entries)

    def clear(self):
        self.entries.clear()
        self.salts.clear()
        self.bytes = 0
        self.counters.clear()

    # ------------------------------------------------------------------ lookup
    def best(self, prompt: list, limit: int, salt=None) -> tuple[Optional[int], int]:
        """(entry id, matched tokens) of the entry of ``salt`` sharing the longest prefix with ``prompt`` (at most
        ``limit`` tokens), or (None, 0)."""
        best, m = None, 0
        for k, (toks, _, _) in self.entries.items():
            if self.salts.get(k) != salt:
                continue
            n = common_prefix(toks, prompt, limit)
            if n > m:
                best, m = k, n
        return best, m

    # ------------------------------------------------------------------ save / restore
    def save(self, rt, row: int, tokens: list, salt=None) -> bool:
        """Copy row ``row``'s K/V at positions 0..len(tokens)-1 (which hold ``tokens``) to host RAM, under ``salt``."""
        n = len(tokens)
        if self.max_bytes <= 0 or n < MIN_TOKENS:
            return False
        toks = tuple(tokens)
        for k, (t, _, _) in list(self.entries.items()):
            if self.salts.get(k) != salt:
                continue
            if len(t) >= n and t[:n] == toks:             # held already (as a prefix of a longer entry)
                self.entries.move_to_end(k)
                return False
            if len(t) < n and toks[:len(t)] == t:        # this one extends it: the old entry is redundant
                self._drop(k)
        snap = [{key: np.array(np.asarray(v)[0, :n]) for key, v in d.items()} for d in rt.take_row(row, n)]
        nbytes = sum(a.nbytes for d in snap for a in d.values())
        if nbytes > self.max_bytes:
            return False
        while self.entries and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.counters["evicted"] += 1
        self.entries[self._next] = (toks, snap, nbytes)
        self.salts[self._next] = salt
        self._next += 1
        self.bytes += nbytes
        self.counters["saved"] += 1
        return True

    def restore(self, rt, key: int, row: int, m: int):
        """Write entry ``key``'s K/V at positions 0..m-1 (a bucket of them) into row ``row`` of the batch cache."""
        toks, snap, _ = self.entries[key]
        self.entries.move_to_end(key)
        # a bucket of positions (>= m: m < the prompt's length <= the cache's), the entry's K/V zero-padded to it:
        # one write program per bucket, not one per entry length (positions m.. are the prompt's to prefill)
        L = min(bucket(m, 64), rt._cache_len)
        def padded(a):                                   # [1, L, ...]: the entry's first L positions, zero-padded
            return np.pad(a[:L], [(0, L - min(L, len(a)))] + [(0, 0)] * (a.ndim - 1))[None]
        rt.put_row([{k: jnp.asarray(padded(a)) for k, a in d.items()} for d in snap], row)
        self.counters["restored"] += 1
        self.counters["restored_tokens"] += m

    def _drop(self, key: int):
        _, _, nbytes = self.entries.pop(key)
        self.salts.pop(key, None)
        self.bytes -= nbytes

