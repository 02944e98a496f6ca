"""What sealing stored KV would cost here: authenticated decryption of a 2,048-token hit of
the default model (92 MiB in 5.6 MiB entries, float32 KV), AES-256-GCM vs ChaCha20-Poly1305,
on 1, 2 and 4 threads (best of 5). Needs the ``cryptography`` package (not yet a dependency):

    python3 -m venv /tmp/aead && /tmp/aead/bin/pip install cryptography
    /tmp/aead/bin/python scripts/aead_throughput.py
"""

import os
import time
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
        for threads in (1, 2, 4):
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda s, a=aead: a.decrypt(nonce, s, header), sealed))
                best = min(best, time.perf_counter() - t0)
            print(
                f"{name}: decrypt {HIT_BYTES >> 20} MiB in {len(entries)} entries on "
                f"{threads} threads: {best * 1e3:.1f} ms ({HIT_BYTES / 2**30 / best:.2f} GiB/s)"
            )


if __name__ == "__main__":
    main()
