"""``kvwise secret``: a new store secret for ``$KVWISE_KV_SECRET`` (or ``--kv-store-secret``),
64 hex digits from 32 random bytes of the OS's generator."""

from __future__ import annotations

import argparse
import secrets


def run(args: argparse.Namespace) -> int:
    print(secrets.token_hex(32))
    return 0
