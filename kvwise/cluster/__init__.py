"""Scale-out: many kvwise replicas behind one endpoint, routed by where the KV already is.

Pure Python (msgpack for the wire), except the two ``ray_*`` modules, the only ones that
import Ray:

- ``kv_events_codec``: KV event batches as msgpack, in vLLM's wire shape;
- ``routing``: the router's index of block hashes per replica and its choice of replica;
- ``event_sync``: numbered batches from a replica, applied in order by the router, with a
  snapshot to recover from a gap;
- ``remote``: ``RemoteEngine``, the ``engine/client.EngineClient`` over replicas in other
  processes (the prompt tokenized and hashed into a route hint here, errors rebuilt by type),
  so the same OpenAI app serves it;
- ``ray_serve``: the Ray Serve application (the engine replicas, the event hub, the ingress
  running the app over a ``RemoteEngine``): ``kvwise serve --ray``;
- ``ray_router``: Ray Serve request routers (cache-aware on the route hint, round robin, the
  power of two choices with pins).
"""
