"""Which proposed tokens a step keeps.

Each of a request's k + 1 rows (its last token, then the k drafts) is sampled as an ordinary token from the target
model's distribution at that position, with the position's own random draw. A draft is kept while it equals the
token sampled where it stands; the first token that differs is kept too, in the draft's place, and ends the run;
when every draft is kept, the last row's token follows them.

Drafts here are deterministic (n-gram lookups, a draft model's argmax), so this is rejection sampling: draft d is
kept with probability p(d), and a rejected position yields p's other tokens in proportion to their probability,
the residual distribution p − δ_d normalised. Every emitted token is therefore distributed as decoding without
speculation would have drawn it, and since a seeded request's draws depend only on (seed, output position), its
tokens are the very ones it would get without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a step emits for one request: `sampled` has one token per row, len(drafts) + 1 of them."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"expected {len(drafts) + 1} sampled tokens for {len(drafts)} drafts, got {len(sampled)}")
    for index, draft in enumerate(drafts):
        if sampled[index] != draft:
            return list(sampled[: index + 1])
    return list(sampled)
