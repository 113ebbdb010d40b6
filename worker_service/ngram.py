"""N-gram (prompt lookup) draft proposal: torch-free, shared by the torch and sim workers.

For n from `lookup_max` down to `lookup_min`: take the request's last n tokens, find their
most recent earlier occurrence in the request's tokens (prompt + output), and propose the
tokens that followed it (up to k). The first n with a match wins; no match, no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (all known, none a placeholder)."""
    length = len(tokens)
    if k < 1 or length < lookup_min + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)  # [length]
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        pattern = seq[length - n :]  # [n]
        windows = sliding_window_view(seq[: length - 1], n)  # [length - n, n]: starts 0 .. length - n - 1
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent match's continuation
            return seq[start : start + k].tolist()
    return []
