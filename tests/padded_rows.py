"""Shared by the batch-invariance tests (test_mtp, test_streaming): forwards padded to the engine's decode width,
the shapes of a decode (1 real row) and of an MTP verify (2-4 real rows)."""

import numpy as np


def padded_forward(eng):
    """fwd(tokens, pos) -> logits [len(tokens), V]: tokens at positions pos.. on the engine's cache, the forward
    padded to ``speculative.decode_width`` (or to len(tokens) when longer, e.g. a prefill)."""
    from glm_jax.runtime import speculative as S

    W = S.decode_width(eng, 3)
    eng._ensure_cache(1, 64)

    def fwd(tokens, pos):
        t = np.zeros((1, max(W, len(tokens))), np.int32)
        t[0, :len(tokens)] = tokens
        lg, _ = eng.forward(t, np.array([pos], np.int32), np.array([len(tokens)], np.int32))
        return np.asarray(lg[0, :len(tokens)])

    return fwd


def rows_logits(fwd, ids, n, start, count=8):
    """Logits [count, V] of ids[start : start+count], n positions per forward (the cache before ``start`` is
    reused as it is)."""
    end = start + count
    return np.concatenate([fwd(ids[p:min(p + n, end)], p) for p in range(start, end, n)])
