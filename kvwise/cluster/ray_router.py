"""Ray Serve request routers for the kvwise replicas (``ray_serve.py`` deploys them).

``KVAwareRouter`` runs inside the ingress's deployment handle. Before each choice it pulls
what the replicas published to the event hub since its cursors (KV event batches, their load)
into its ``PrefixIndex`` (``event_sync``), then lets ``CacheAwarePolicy`` pick from the
request's ``RouteHint`` (the tenant-rooted block-hash chain the ingress computed): the
replica holding the longest prefix, weighed against load, else the power of two choices —
with, on a tie, the replica that served the session's last turn (its host and disk tiers may
hold what its pool evicted or parked). The index holds hashes only. A replica that died is
dropped from the index and the hub at once (``on_replica_actor_died``).

``RoundRobinRouter`` is the benchmark's cache-blind baseline; Ray's own default is the power
of two choices (``PowerOfTwoChoicesRequestRouter``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import ray
from ray.serve.request_router import RequestRouter

from kvwise.cluster.event_sync import IndexSync, sync_from_hub
from kvwise.cluster.remote import RouteHint
from kvwise.cluster.routing import CacheAwarePolicy, Load, PrefixIndex, RecentWork

logger = logging.getLogger("kvwise.cluster")

HUB_NAMESPACE = "kvwise"
# tokens routed to a replica count towards its load until the replica acknowledges them, or
# for this long at most (an acknowledgement lost on the way)
RECENT_S = 0.5


def route_hint(pending_request) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None


def _pinned(candidates, hint: RouteHint | None):
    if hint is not None and hint.pin is not None:
        for replica in candidates:
            if replica.replica_id.unique_id == hint.pin:
                return replica
    return None


class KVAwareRouter(RequestRouter):
    def initialize_state(
        self,
        hub_name: str = "kvwise-hub",
        block_size: int = 16,
        overlap_weight: float = 1.0,
        imbalance_tokens: int = 16_384,
    ) -> None:
        self.hub_name = hub_name
        self.sync = IndexSync(PrefixIndex())
        self.policy = CacheAwarePolicy(
            self.sync.index, block_size, overlap_weight, imbalance_tokens
        )
        self.loads: dict[str, tuple[int, int]] = {}
        # requests routed and not yet in their replica's published load: counted as queued
        self.recent = RecentWork(RECENT_S)
        self._request_keys: dict[str, tuple[str, str]] = {}  # Ray's id -> (replica, ours)
        self.reasons: Counter[str] = Counter()
        self._hub = None

    def hub(self):
        if self._hub is None:
            self._hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        return self._hub

    async def refresh(self) -> None:
        """Pull the replicas' new batches and loads; ask for snapshots past a gap."""
        try:
            hub = self.hub()
            reply = await hub.pull.remote(dict(self.sync.cursor), self.recent.pending())
        except Exception as exc:  # noqa: BLE001 - the hub restarting: route on what we know
            logger.warning("event hub unreachable (%s): routing on the last index", exc)
            self._hub = None
            return
        self.loads = sync_from_hub(self.sync, reply)
        for replica, item in reply.items():
            self.recent.acknowledged(replica, item.get("acked", ()))
        for replica in self.sync.need_snapshot:
            hub.want_snapshot.remote(replica)

    def load_of(self, replica: str, now: float) -> Load:
        queued, running = self.loads.get(replica, (0, 0))
        return Load(queued + self.recent.tokens(replica, now), running)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        key = self._request_keys.pop(internal_request_id, None)
        if key is not None:
            self.recent.completed(*key)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        hint = route_hint(pending_request)
        pinned = _pinned(candidate_replicas, hint)
        if pinned is not None or not candidate_replicas:
            return [[pinned]] if pinned is not None else []
        await self.refresh()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        loads = {rid: self.load_of(rid, now) for rid in by_id}
        chain = hint.chain if hint else ()
        num_tokens = hint.num_tokens if hint else 0
        choice = self.policy.choose(chain, num_tokens, loads)
        chosen = choice.replica
        if choice.reason == "power-of-two" and hint and hint.session_replica in by_id:
            least = min(load.tokens for load in loads.values())
            if loads[hint.session_replica].tokens - least <= self.policy.imbalance_tokens:
                chosen = hint.session_replica
        self.reasons[choice.reason] += 1
        if pending_request is not None:  # the work it adds there: what it must prefill
            internal_id = pending_request.metadata.internal_request_id
            request_id = (hint.request_id if hint else None) or internal_id
            cached = self.sync.index.overlap(chosen, chain) * self.policy.block_size
            self.recent.add(chosen, request_id, now, max(num_tokens - cached, 0))
            self._request_keys[internal_id] = (chosen, request_id)
        rest = [r for rid, r in sorted(by_id.items()) if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.sync.drop(rid)
        self.loads.pop(rid, None)
        self.recent.drop(rid)
        try:
            self.hub().drop.remote(rid)
        except Exception:  # noqa: BLE001 - the hub forgets it when it restarts anyway
            pass


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (a pinned request to its replica)."""

    def initialize_state(self, **kwargs) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        pinned = _pinned(candidate_replicas, route_hint(pending_request))
        if pinned is not None or not candidate_replicas:
            return [[pinned]] if pinned is not None else []
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        first = replicas[self.turn % len(replicas)]
        return [[first], [r for r in replicas if r is not first]]


def _power_of_two_class():
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

    return PowerOfTwoChoicesRequestRouter


class PinnedPowerOfTwoRouter(_power_of_two_class()):
    """Ray Serve's default router (the power of two choices, by queue length), cache-blind,
    with pinned requests (``park``) sent to their replica."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        pinned = _pinned(candidate_replicas, route_hint(pending_request))
        if pinned is not None:
            return [[pinned]]
        return await super().choose_replicas(candidate_replicas, pending_request)


ROUTERS = {
    "cache-aware": KVAwareRouter,
    "power-of-two": PinnedPowerOfTwoRouter,
    "round-robin": RoundRobinRouter,
}
