"""``up --role-controller``: workers move between the prefill and decode roles as the load's mix
changes (DistServe's and Splitwise's point: each phase sized for what it is asked now).

Every ``--role-check-interval-s`` the controller reads the gateway's TTFT and TPOT histograms
(``/metrics``: what ended since the last check, so the quantiles are of the recent past) and
the workers' load from the Redis registry, and compares:

* first tokens late (TTFT p90 over ``--role-ttft-target-ms``) while tokens after them are on time
  with room to spare (TPOT p90 under ``HEADROOM`` of its target), and prompts queue on the prefill
  workers (at least one each, running or waiting: the prefill pool is what is short, not pages
  on the decode side): a decode worker becomes a prefill worker;
* tokens late while first tokens have room and the decode workers have requests running: a
  prefill worker becomes a decode worker;
* both late, both on time, or nothing measured: nothing moves (a move would only shift the pain).

A move needs its condition at ``PATIENCE`` checks in a row (hysteresis: a burst does not flip a
worker), at least ``--role-change-interval-s`` since the last move (a bounded rate of change,
and a new worker's effect is seen before the next), and leaves at least
``--min-prefill-workers`` and ``--min-decode-workers`` of each role. A moved worker drains as on
SIGTERM (it leaves the registry, so no new request is placed on it; its requests finish, or
resume on another worker with the tokens already streamed) and starts again in its new role on
the same cores; no request is lost and its pages go with the process.

On Kubernetes the same signals drive the cluster's autoscalers instead
(``deploy/kubernetes/autoscaling``, docs/deploy.md): a pod does not change its role, the fleet
of each role grows and shrinks.
"""
from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

# The other quantity must be this far under its target before a worker is taken from its role.
HEADROOM = 0.8
# Checks in a row a move's condition must hold.
PATIENCE = 3
QUANTILE = 0.9
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"


@dataclass(frozen=True)
class RoleControl:
    """``up``'s controller settings (flags of the same names)."""
    role_controller: bool = False  # move workers between prefill and decode as the load changes
    min_prefill_workers: int = 1  # never fewer (0 needs --disaggregation never or auto)
    min_decode_workers: int = 1  # never fewer
    role_ttft_target_ms: float = 1000.0  # first-token target: late first tokens ask for prefill workers
    role_tpot_target_ms: float = 100.0  # per-token target: late tokens ask for decode workers
    role_check_interval_s: float = 5.0  # how often the gateway's latencies are read
    role_change_interval_s: float = 60.0  # the least time between two moves

    def __post_init__(self):
        for name in ("min_prefill_workers", "min_decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.min_decode_workers < 1:
            raise ValueError("--min-decode-workers must be >= 1: decode workers stream every token")
        for name in ("role_ttft_target_ms", "role_tpot_target_ms", "role_check_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.role_change_interval_s < 0:
            raise ValueError(f"--role-change-interval-s must be >= 0, got {self.role_change_interval_s}")

    def check_fleet(self, prefill: int, decode: int, disaggregation: str) -> None:
        """Refuse, naming the flag, a fleet the minimums cannot hold (at start)."""
        if prefill == 0 and decode == 0:
            raise ValueError("--role-controller moves prefill and decode workers; a colocated worker has no role "
                             "to change (give --prefill and --decode)")
        if self.min_prefill_workers + self.min_decode_workers > prefill + decode:
            raise ValueError(f"--min-prefill-workers {self.min_prefill_workers} plus --min-decode-workers "
                             f"{self.min_decode_workers} is more than the {prefill + decode} workers up starts "
                             f"(--prefill {prefill} --decode {decode})")
        if prefill < self.min_prefill_workers or decode < self.min_decode_workers:
            raise ValueError(f"--prefill {prefill} --decode {decode} starts below --min-prefill-workers "
                             f"{self.min_prefill_workers} / --min-decode-workers {self.min_decode_workers}")
        if self.min_prefill_workers == 0 and disaggregation == "always":
            raise ValueError("--min-prefill-workers 0 leaves decode workers alone, which serve only under "
                             "--disaggregation never or auto")


@dataclass(frozen=True)
class Latencies:
    """The gateway's p90s over one check interval; None where no request gave one."""
    ttft_ms: float | None
    tpot_ms: float | None


@dataclass(frozen=True)
class Signals:
    """One check's view of the stack."""
    latencies: Latencies
    prefill_queue: float | None  # requests in the prefill workers' engines (running or waiting), per
    #                              prefill worker; None without prefill workers (decode workers prefill)
    decode_running: float  # requests in the decode workers' running batches, per decode worker


@dataclass(frozen=True)
class Move:
    to_role: str  # "prefill" or "decode": a worker of the other role takes it
    why: str


class RolePolicy:
    """Decides moves from one check's latencies and the fleet (unit-tested on its inputs)."""

    def __init__(self, control: RoleControl):
        self.control = control
        self._streak: tuple[str | None, int] = (None, 0)
        self._last_move_s = -math.inf

    def wanted(self, signals: Signals, prefill: int, decode: int) -> Move | None:
        """The move this check's figures ask for, before hysteresis and rate."""
        c = self.control
        ttft, tpot = signals.latencies.ttft_ms, signals.latencies.tpot_ms
        if ttft is None or tpot is None:
            return None
        queued = signals.prefill_queue is None or signals.prefill_queue >= 1.0
        if ttft > c.role_ttft_target_ms and tpot < HEADROOM * c.role_tpot_target_ms and queued \
                and decode > c.min_decode_workers:
            return Move("prefill", f"TTFT p90 {ttft:.0f} ms > {c.role_ttft_target_ms:.0f} ms, prompts queued on "
                                   f"prefill, TPOT p90 {tpot:.0f} ms has room")
        if tpot > c.role_tpot_target_ms and ttft < HEADROOM * c.role_ttft_target_ms \
                and signals.decode_running >= 1.0 and prefill > c.min_prefill_workers:
            return Move("decode", f"TPOT p90 {tpot:.0f} ms > {c.role_tpot_target_ms:.0f} ms with "
                                  f"{signals.decode_running:.1f} requests per decode worker, TTFT p90 {ttft:.0f} ms "
                                  f"has room")
        return None

    def observe(self, signals: Signals, prefill: int, decode: int, now_s: float) -> Move | None:
        """One check: the move to make now, if its condition held ``PATIENCE`` checks in a row and
        the last move is ``role_change_interval_s`` old."""
        move = self.wanted(signals, prefill, decode)
        role = move.to_role if move else None
        count = self._streak[1] + 1 if role is not None and role == self._streak[0] else 1
        self._streak = (role, count)
        if move is None or count < PATIENCE or now_s - self._last_move_s < self.control.role_change_interval_s:
            return None
        self._streak = (None, 0)
        self._last_move_s = now_s
        return move


class LatencyWindow:
    """The gateway's latency histograms between two reads: p90 of what ended in between."""

    def __init__(self, metrics_address: str):
        self.url = f"http://{metrics_address}/metrics"
        self._last: dict[str, dict[float, float]] = {}

    def read(self) -> Latencies:
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(self.url, timeout=5) as response:
            text = response.read().decode()
        now: dict[str, dict[float, float]] = {TTFT: {}, TPOT: {}}
        for family in text_string_to_metric_families(text):
            if family.name in now:
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        le = float(sample.labels["le"])
                        now[family.name][le] = now[family.name].get(le, 0.0) + sample.value
        last, self._last = self._last, now
        return Latencies(*(None if name not in last else _ms(window_quantile(last[name], now[name], QUANTILE))
                           for name in (TTFT, TPOT)))


def window_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of the observations a cumulative histogram gained between two reads
    (bucket upper bound -> count), interpolated within its bucket as Prometheus'
    ``histogram_quantile`` does; None when it gained none."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower  # in the open-ended bucket: its lower bound, as Prometheus does
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def worker_load(entries: list[dict]) -> tuple[float | None, float]:
    """(prefill queue per prefill worker or None, running requests per decode worker) from the
    Redis registry's entries (``RedisState.workers()``)."""
    def stat(entry: dict, name: str) -> float:
        return float((entry.get("stats") or {}).get(name, 0))
    prefill = [e for e in entries if e.get("role") == "prefill"]
    decode = [e for e in entries if e.get("role") == "decode"]
    queue = (sum(stat(e, "num_running") + stat(e, "num_waiting") for e in prefill) / len(prefill)) if prefill else None
    running = sum(stat(e, "num_running") for e in decode) / len(decode) if decode else 0.0
    return queue, running


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


class RoleController:
    """Runs ``RolePolicy``'s moves on ``up``'s workers, one at a time: the worker drains and exits
    (``Supervisor.retire``), then starts again in its new role on the same cores and ports
    (``Supervisor.respawn``). ``tick`` runs on the supervisor's loop (the main thread, which
    spawns every child)."""

    def __init__(self, control: RoleControl, supervisor, respec, latencies: LatencyWindow, registry, say,
                 drain_s: float):
        """``respec(role, name, old_spec)``: the ChildSpec of a worker of ``role`` named ``name`` in the
        place of ``old_spec``; ``registry()``: the Redis registry's entries; ``drain_s``: how long a
        retiring worker may take to exit before it is killed."""
        self.control = control
        self.policy = RolePolicy(control)
        self.supervisor = supervisor
        self.respec = respec
        self.latencies = latencies
        self.registry = registry
        self.say = say
        self.drain_s = drain_s
        self.moves: list[dict] = []  # what moved, when and why (for up's log and the bench)
        self._next_check_s = 0.0
        self._moving = None  # (child, Move, stage: "draining" | "starting", since_s)

    def roles(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0}
        for child in self.supervisor.children:
            role = worker_role(child.spec.name)
            if role in counts:
                counts[role] += 1
        return counts

    def tick(self, now_s: float) -> None:
        if self._moving is not None:
            self._advance(now_s)
            return
        if now_s < self._next_check_s:
            return
        self._next_check_s = now_s + self.control.role_check_interval_s
        try:
            latencies = self.latencies.read()
            queue, running = worker_load(self.registry())
        except Exception as e:  # the gateway or Redis restarting: the next check reads again
            self.say(f"role controller: could not read the stack's load ({e})")
            return
        roles = self.roles()
        move = self.policy.observe(Signals(latencies, queue, running), roles["prefill"], roles["decode"], now_s)
        if move is None:
            return
        source = "decode" if move.to_role == "prefill" else "prefill"
        child = [c for c in self.supervisor.children if worker_role(c.spec.name) == source][-1]
        self.say(f"role controller: {child.spec.name} becomes a {move.to_role} worker: {move.why}")
        self.moves.append({"at_s": now_s, "worker": child.spec.name, "to_role": move.to_role, "why": move.why})
        self.supervisor.retire(child)
        self._moving = (child, move, "draining", now_s)

    def _advance(self, now_s: float) -> None:
        child, move, stage, since_s = self._moving
        if stage == "draining":
            if child.proc.poll() is None:
                if now_s - since_s > self.drain_s:
                    self.say(f"role controller: {child.spec.name} did not drain within {self.drain_s:.0f} s; "
                             "killing it")
                    child.process.kill()
                return
            old = child.spec
            names = {c.spec.name for c in self.supervisor.children}
            name = next(f"{move.to_role}{i}" for i in range(len(names) + 1) if f"{move.to_role}{i}" not in names)
            self.supervisor.respawn(child, self.respec(move.to_role, name, old))
            self._moving = (child, move, "starting", now_s)
        elif child.line:
            self.say(f"role controller: {child.spec.name} serves (pid {child.proc.pid})")
            self._moving = None
        elif child.proc.poll() is not None:  # it could not start: the supervisor restarts it as usual
            self._moving = None


def worker_role(name: str) -> str:
    """A worker child's role from its name (prefill0, decode1, both); "" for the others."""
    for role in ("prefill", "decode", "both"):
        if name.startswith(role):
            return role
    return ""
