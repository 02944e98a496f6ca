"""What opening an entry read in place costs now that it is decrypted through a scratch slice
(``serde.open_parts``: cryptography >= 51 refuses to decrypt into the buffer it reads), against
opening the same entry from a read buffer into separate pool buffers (``serde.open_into``: no
copy back, the lower bound): one 8-block chunk of the default model (5.6 MiB, float32 KV),
interleaved, medians of 15, on one thread::

    .venv/bin/python scripts/open_in_place_ab.py
"""

import os
import statistics
import time

import cryptography

from kvwise.core.kv_spec import KVSpec
from kvwise.store import serde

FMT = serde.EntryFormat(KVSpec(30, 3, 64, 16, "float32"), "smollm2", secret=b"s" * 32)
NUM_BLOCKS = 8


def main() -> None:
    hashes = [os.urandom(32) for _ in range(NUM_BLOCKS)]
    payload_bytes = NUM_BLOCKS * FMT.group_block_bytes(0)
    value = serde.pack(FMT, hashes, 0, 0, os.urandom(payload_bytes))
    key = FMT.entry_key(hashes[-1], 0)
    head_end = FMT.head_bytes(NUM_BLOCKS)
    block = FMT.group_block_bytes(0)
    in_place, into = [], []
    for _ in range(15):
        parts = [bytearray(value[:head_end])]
        parts += [
            bytearray(value[head_end + i * block : head_end + (i + 1) * block])
            for i in range(NUM_BLOCKS)
        ]
        parts.append(bytearray(value[-serde.TAG_SIZE :]))
        t0 = time.perf_counter()
        serde.open_parts(FMT, key, parts)
        in_place.append(time.perf_counter() - t0)
        dests = [bytearray(32 * NUM_BLOCKS)] + [bytearray(block) for _ in range(NUM_BLOCKS)]
        t0 = time.perf_counter()
        serde.open_into(FMT, key, value, dests)
        into.append(time.perf_counter() - t0)
    a, b = statistics.median(in_place), statistics.median(into)
    mib = len(value) / 2**20
    print(f"cryptography {cryptography.__version__}, entry {mib:.2f} MiB")
    print(f"in place through the scratch slice: {a * 1e3:.2f} ms ({mib / 1024 / a:.2f} GiB/s)")
    print(f"into separate buffers:              {b * 1e3:.2f} ms ({mib / 1024 / b:.2f} GiB/s)")
    print(f"ratio in place / into: {a / b:.3f}")


if __name__ == "__main__":
    main()
