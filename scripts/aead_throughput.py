"""What sealing stored KV costs here: authenticated decryption of a 2,048-token hit of the
default model (92 MiB in 5.6 MiB entries, float32 KV), AES-256-GCM vs ChaCha20-Poly1305, on
1, 2 and 4 threads (best of 5), into fresh buffers (``decrypt``) and into buffers that already
exist (``decrypt_into``: what kvwise does, opening entries where they landed in the device
pool); and crc32 of the same bytes (what entries carried before they were sealed)::

    .venv/bin/python scripts/aead_throughput.py
"""

import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

HIT_BYTES = 92 * 2**20  # 2,048 tokens x 46,080 B
ENTRY_BYTES = 8 * 737_280 + 400  # one 8-block chunk and its header


def main() -> None:
    data = os.urandom(HIT_BYTES)
    entries = [data[i : i + ENTRY_BYTES] for i in range(0, len(data), ENTRY_BYTES)]
    nonce, header = os.urandom(12), b"the entry header, as associated data"
    for name, cls in (("AES-256-GCM", AESGCM), ("ChaCha20-Poly1305", ChaCha20Poly1305)):
        key = AESGCM.generate_key(bit_length=256) if cls is AESGCM else cls.generate_key()
        aead = cls(key)
        sealed = [aead.encrypt(nonce, e, header) for e in entries]
        into = [bytearray(len(e)) for e in entries]
        calls = {
            "decrypt": lambda i, a=aead, s=sealed: a.decrypt(nonce, s[i], header),
            "decrypt_into": lambda i, a=aead, s=sealed, o=into: a.decrypt_into(
                nonce, s[i], header, o[i]
            ),
        }
        for call, fn in calls.items():
            for threads in (1, 2, 4):
                best = _best(fn, len(entries), threads)
                print(
                    f"{name} {call}: {HIT_BYTES >> 20} MiB in {len(entries)} entries on "
                    f"{threads} threads: {best * 1e3:.1f} ms ({HIT_BYTES / 2**30 / best:.2f} GiB/s)"
                )
    for threads in (1, 2):
        best = _best(lambda i: zlib.crc32(entries[i]), len(entries), threads)
        print(f"crc32: {HIT_BYTES >> 20} MiB on {threads} threads: {best * 1e3:.1f} ms")


def _best(fn, n: int, threads: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, range(n)))
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    main()
