"""Prompt-lookup proposals: the tokens that followed an earlier occurrence of the sequence's own suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts for the sequence `tokens`: for the longest n in max_n..min_n whose last n tokens occurred
    earlier, the tokens after the latest such occurrence (fewer when the sequence ends first); [] with no match.

    The latest occurrence is taken because recent text is what a copying continuation most often repeats.
    """
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = array[length - n :]
        # Every earlier window of n tokens (those that start before the suffix does), compared at once.
        windows = sliding_window_view(array[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return array[start : start + k].tolist()
    return []
