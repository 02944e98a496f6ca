"""Layering: the core and the store are pure Python (no torch), the engine can be assembled
and served without torch (on the fake runner), and the core depends on no other layer."""

import ast
import pathlib
import subprocess
import sys

import kvwise

PACKAGE = pathlib.Path(kvwise.__file__).parent


def test_core_store_and_assembled_engine_import_no_torch():
    code = (
        "import sys\n"
        "import kvwise.core.scheduler, kvwise.core.block_pool, kvwise.core.kv_cache_manager\n"
        "import kvwise.core.hashing, kvwise.core.kv_spec, kvwise.core.kv_tiers\n"
        "import kvwise.worker.fake_runner, kvwise.config, kvwise.types, kvwise.errors\n"
        "import kvwise.perf.sizing\n"
        "import kvwise.store.tiered, kvwise.store.host, kvwise.store.disk, kvwise.store.redis\n"
        "import kvwise.store.costmodel, kvwise.store.serde, kvwise.store.planner\n"
        "import kvwise.store.reader, kvwise.store.writer, kvwise.store.registry\n"
        "import kvwise.store.disk_files, kvwise.store.base, kvwise.store.index\n"
        "import kvwise.engine.assemble, kvwise.engine.llm_engine, kvwise.engine.async_engine\n"
        "import kvwise.server.app\n"
        "from tests.fakes import fake_engine\n"
        "fake_engine().add_request('hello')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = PACKAGE.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def _kvwise_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("kvwise.")}


def test_core_imports_no_other_layer():
    # the core is bookkeeping: the tiers, the worker and the engine depend on it, never the
    # other way round (it talks to the tiers through the KVTierPlanner protocol)
    allowed = (
        "kvwise.core",
        "kvwise.types",
        "kvwise.errors",
        "kvwise.utils",
    )  # not config: it composes the core's configs
    for path in sorted((PACKAGE / "core").glob("*.py")):
        bad = [m for m in _kvwise_imports(path) if not m.startswith(allowed)]
        assert not bad, f"{path.name} imports {bad}"
