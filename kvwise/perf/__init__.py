"""The offline performance model: what KV caching costs and saves, worked out before (or
without) running an engine.

- ``sizing``: KV bytes per token, request and batch, every KV format (``kvwise size``);
  ``gguf_meta``: a GGUF's scalar metadata read with ``struct`` (its KV shape without torch);
- ``roofline``: step times from bytes moved and FLOPs, on hardware presets or this machine's
  calibration; ``roofline_fit``: fitting it to measurements;
- ``predict``: TTFT against prefix length and each tier's break-even (``kvwise breakeven``);
- ``claims``: the break-even a published KV-cache speedup implies (``kvwise claims``);
- ``calibrate``: measures this machine for the roofline (``kvwise breakeven --calibrate``).

Pure Python except ``calibrate``, which imports torch inside its functions: importing any
module here imports no torch.
"""
