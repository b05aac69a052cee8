"""Where two greedy token sequences part, and whether that first difference is a near-tie of the logits."""

from __future__ import annotations

from collections.abc import Sequence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def is_near_tie(
    ours: Sequence[int], ours_top: Sequence[set[int]], theirs: Sequence[int], theirs_top: Sequence[set[int]]
) -> bool:
    """At the first divergence, each side's token is among the other's top tokens: a rounding-level difference
    (a different GEMM kernel, bf16 accumulation order), not a wrong result. False where nothing diverges."""
    index = first_divergence(ours, theirs)
    if index >= min(len(ours), len(theirs)):
        return False
    return ours[index] in theirs_top[index] and theirs[index] in ours_top[index]
