"""The core and the store are pure Python: importing them must not import torch."""

import subprocess
import sys


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import kvwise.core.scheduler, kvwise.core.block_pool, kvwise.core.kv_cache_manager\n"
        "import kvwise.core.hashing, kvwise.worker.fake_runner, kvwise.config, kvwise.types\n"
        "import kvwise.store.tiered, kvwise.store.host, kvwise.store.disk, kvwise.store.redis\n"
        "import kvwise.store.costmodel, kvwise.store.serde, kvwise.store.planner\n"
        "import kvwise.store.reader, kvwise.store.writer, kvwise.store.registry\n"
        "import kvwise.store.disk_files, kvwise.store.base, kvwise.store.index\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
