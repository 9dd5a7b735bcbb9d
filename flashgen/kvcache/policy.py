"""Out-of-pages policies: what a call that needs more pages than are free may reclaim, decided before any state
changes, so a call that cannot be satisfied raises ``OutOfPages`` and leaves the cache as it was.

- ``raise`` (default): only free pages are used; cached prefix pages stay (``cache.evict()`` drops them).
- ``evict``: then the least recently released unreferenced prefix-cache pages.
- ``swap``: then evict, then preempt victims by copying their pages to host memory (``cache.resume`` brings
  them back, byte for byte, into whatever pages are free).
- ``recompute``: then evict, then preempt victims by freeing them (the caller recomputes their K/V).

The victim rule (swap, recompute): the most recently added live sequence that is not protected (the sequence
being grown is always protected; ``cache.protect`` adds others), then the next most recent, until enough
pages would be free. A victim whose pages are all shared with survivors frees nothing, so the plan counts
pages by their refcounts, not by the victim's table length.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("raise", "evict", "swap", "recompute")


class OutOfPages(RuntimeError):
    """Not enough pages for a call under the cache's out-of-pages policy; the cache is unchanged.

    ``requested``: pages the call needed; ``free``: pages on the free list; ``cached``: unreferenced prefix-cache
    pages (reclaimable with ``cache.evict()`` or ``out_of_pages="evict"``); ``policy``: the policy in force.
    """

    def __init__(self, what: str, requested: int, free: int, cached: int, policy: str, note: str = ""):
        self.requested, self.free, self.cached, self.policy = requested, free, cached, policy
        super().__init__(f"{what}: needs {requested} page(s), {free} free and {cached} cached unreferenced "
                         f"(out_of_pages={policy!r}){note}")


@dataclass(frozen=True)
class Preemption:
    """A sequence preempted to free pages: ``kind`` "swap" (its K/V is in host memory; ``cache.resume(seq_id)``
    restores it) or "recompute" (freed: the caller must recompute ``num_tokens`` tokens of K/V)."""

    seq_id: object
    kind: str
    num_tokens: int


def plan_victims(what: str, need: int, free: int, cached: int, policy: str, candidates: list,
                 refcount: list[int]) -> tuple:
    """The sequences to preempt so that ``need`` pages can be had (then evicting cached pages covers the rest),
    or ``OutOfPages``. ``candidates``: ``(seq_id, pages)`` of preemptable sequences in victim order (most
    recently added first); ``refcount``: the pool's counts.

    Example: need 3, free 1, cached 1, policy "swap", candidates [("b", [4, 5]), ("a", [4, 6])] with page 4
    shared: free and cached give 2; preempting "b" frees page 5 only (4 is still held by "a"): 3, enough.
    """
    if need <= free:
        return ()
    if policy == "raise":
        raise OutOfPages(what, need, free, cached, policy)
    if need <= free + cached:
        return ()
    if policy == "evict":
        raise OutOfPages(what, need, free, cached, policy)
    have, victims, dropped = free + cached, [], {}
    for seq_id, pages in candidates:
        victims.append(seq_id)
        for p in pages:
            dropped[p] = dropped.get(p, 0) + 1
            have += dropped[p] == refcount[p]  # its last reference: the page becomes free (or cached, evictable)
        if have >= need:
            return tuple(victims)
    raise OutOfPages(what, need, free, cached, policy,
                     f"; preempting every unprotected sequence would free only {have - free - cached} more")
