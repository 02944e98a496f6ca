"""Scale-out: many kvwise replicas behind one endpoint, routed by where the KV already is.

- ``kv_events_codec``: KV event batches as msgpack, in vLLM's wire shape;
- ``routing``: the router's index of block hashes per replica and its choice of replica;
- ``event_sync``: numbered batches from a replica, applied in order by the router, with a
  snapshot to recover from a gap.
"""
