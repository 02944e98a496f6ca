"""The runners implement core/runner.py's ModelRunner protocol: the fake one checked on an
instance, the torch one by reading its source (no torch imported here)."""

import ast
import inspect
import pathlib

import kvwise
from kvwise.core.runner import ModelRunner
from kvwise.worker.fake_runner import FakeModelRunner
from tests.fakes import ControlledRunner, fake_engine

METHODS = {
    n: f for n, f in vars(ModelRunner).items() if inspect.isfunction(f) and not n.startswith("_")
}
ATTRS = set(ModelRunner.__annotations__)


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_protocol_names_what_the_engine_uses():
    assert set(METHODS) == {"execute", "save_kv", "write_kv", "payload_views"}
    assert ATTRS == {
        "spec",
        "num_blocks",
        "num_layers",
        "vocab_size",
        "skips_cached_writes",
        "reads_in_place",
    }


def test_the_fake_runner_implements_it():
    runner = FakeModelRunner(num_blocks=8, block_size=4)
    assert isinstance(runner, ModelRunner)
    assert isinstance(ControlledRunner(runner), ModelRunner)  # the wrapper tests use
    for name, want in METHODS.items():
        assert _parameters(getattr(FakeModelRunner, name)) == _parameters(want), name
    assert isinstance(fake_engine().runner, ModelRunner)


def test_the_torch_runner_implements_it():
    path = pathlib.Path(kvwise.__file__).parent / "worker" / "model_runner.py"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner"]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    for name, want in METHODS.items():
        assert name in methods, f"worker ModelRunner lacks {name}"
        args = methods[name].args
        assert [a.arg for a in args.posonlyargs + args.args] == _parameters(want), name
    assigned = {
        t.attr
        for n in ast.walk(methods["__init__"])
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert ATTRS <= assigned, f"worker ModelRunner lacks {ATTRS - assigned}"
