"""The one priority rule of splitserve: which of two waiting requests goes first.

Lower ``priority`` values go first; a waiting request gains ``aging_per_s`` priority points per
second it has waited, so low priority cannot starve. At any moment ``t`` request 1 goes before
request 2 when ``p1 - a(t - t1) < p2 - a(t - t2)``, i.e. when ``t1 + p1/a < t2 + p2/a``: the order
of two waiting requests never changes while they wait, so it needs no clock and can be a fixed
sort key. ``t + p/a`` reads as a *virtual arrival time*: one priority point is worth ``1/a``
seconds of waiting (with the default of 1 point per second, a priority-0 request that arrives
10 s after a priority-10 one ties with it). Ties go to the earlier real arrival. Without aging
(``a = 0``) the order is priority first, then arrival.

The gateway's Redis queue scores requests with this key (``splitserve.state.store.queue_score``),
and the engines' schedulers sort their queues with it, using the request's original arrival
time (carried from the gateway to the workers), so every queue a request waits in agrees.
"""
from __future__ import annotations


def priority_key(priority: int, arrival_s: float, aging_per_s: float) -> tuple[float, float]:
    """Sort key of a waiting request, smaller first. ``arrival_s`` on any one clock shared by
    the requests compared; ``aging_per_s`` >= 0 priority points per second of waiting."""
    if aging_per_s > 0:
        return arrival_s + priority / aging_per_s, arrival_s
    return float(priority), arrival_s
