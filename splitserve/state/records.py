"""What crosses between ``RedisState`` and Redis: the replies' types, and how a value becomes a
hash field and comes back (``splitserve/state/store.py`` makes the calls).

Every value Redis returns may be bytes (a client without ``decode_responses``); ``text`` makes it
a ``str``. Structured fields (lists, dicts) are stored as compact JSON; a request's numeric fields
come back as numbers, its payload as the object it was.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

# Fields owned by the scripts; update()/finish() may not write them.
_RESERVED_FIELDS = frozenset({"epoch", "attempt", "gateway", "priority", "arrival", "score",
                              "payload", "admit_token", "owner"})
_INT_FIELDS = ("attempt", "epoch", "priority")
_FLOAT_FIELDS = ("arrival", "score")


@dataclass(frozen=True)
class AdmitResult:
    """``status``: "admitted", "duplicate" (the id exists: nothing was written) or "full".
    ``depth``: the pending-queue depth after the call. ``state``: the request's state
    ("queued" when admitted, the existing request's state when a duplicate, None when full)."""
    status: Literal["admitted", "duplicate", "full"]
    depth: int
    state: str | None = None
    # Claimed in the same call (``admit(claim_lease_s=...)``): the claim, as ``claim`` returns it.
    claimed: "Claimed | None" = None

    @property
    def admitted(self) -> bool:
        return self.status == "admitted"

    @property
    def detail(self) -> str | int | None:
        """The existing request's state for a duplicate, else the queue depth."""
        return self.state if self.status == "duplicate" else self.depth


class Claimed(str):
    """A claimed request id (a plain ``str``) that also carries the claim's ``epoch`` (the
    fencing token for ``update``/``extend_lease``/``finish``) and ``attempt``."""
    epoch: int
    attempt: int

    def __new__(cls, request_id: str, epoch: int, attempt: int) -> "Claimed":
        obj = super().__new__(cls, request_id)
        obj.epoch = epoch
        obj.attempt = attempt
        return obj


def text(value: Any) -> Any:
    """A reply's bytes as ``str`` (anything else as it is)."""
    return value.decode() if isinstance(value, bytes) else value


def encode_field(value: Any) -> Any:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, (bool, type(None))):
        raise TypeError(f"cannot store {value!r} in a Redis hash field")
    return value


def float_arg(value: float) -> str:
    return repr(float(value))


def claimed_ids(reply: list) -> list[Claimed]:
    if text(reply[0]) != "claimed":
        return []
    return [Claimed(text(reply[i]), int(reply[i + 1]), int(reply[i + 2])) for i in range(1, len(reply), 3)]


def request_fields(raw: dict) -> dict[str, Any] | None:
    if not raw:
        return None
    out = {text(k): text(v) for k, v in raw.items()}
    out.pop("admit_token", None)
    out.pop("admit_claim", None)
    for k in _INT_FIELDS:
        if k in out:
            out[k] = int(out[k])
    for k in _FLOAT_FIELDS:
        if k in out:
            out[k] = float(out[k])
    if "payload" in out:
        out["payload"] = json.loads(out["payload"])
    return out


def worker_entries(flat: list, trusted: Callable[[str, dict[str, str]], bool]) -> list[dict[str, Any]]:
    out = []
    for i in range(0, len(flat), 2):
        fields = flat[i + 1]
        worker_id = text(flat[i])
        d = {text(fields[j]): text(fields[j + 1]) for j in range(0, len(fields), 2)}
        if not trusted(worker_id, d):
            # Its JSON fields are not parsed: whoever wrote them may have written anything. Role and
            # address stay, for the gateway's log line.
            out.append({"worker_id": worker_id, "role": d.get("role", ""), "address": d.get("address", ""),
                        "transports": [], "stats": {},
                        "updated": 0.0, "trusted": False})
            continue
        out.append({"worker_id": worker_id, "role": d.get("role", ""), "address": d.get("address", ""),
                    "transports": json.loads(d.get("transports", "[]")),
                    "stats": json.loads(d.get("stats", "{}")),
                    "updated": float(d.get("updated", 0.0)), "trusted": True})
    out.sort(key=lambda w: w["worker_id"])
    return out


def check_id(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"ids must be non-empty strings, got {value!r}")
    return value


def field_pairs(fields: dict[str, Any]) -> list[Any]:
    bad = _RESERVED_FIELDS.intersection(fields)
    if bad:
        raise ValueError(f"fields {sorted(bad)} are owned by the queue scripts")
    out: list[Any] = []
    for k, v in fields.items():
        out += [k, encode_field(v)]
    return out


def ttl_pair(ttl_s: float) -> tuple[int, int]:
    ttl_ms = max(1, round(ttl_s * 1000))
    return ttl_ms, 10 * ttl_ms
