"""The package's layers import only downward: core < sides < measure < train < cli < workflow
(``workflow.gpucheck`` drives the CLI). Every ``import``/``from`` of every module is read,
including those inside functions."""

import ast

import pytest

from tests.conftest import REPO

LAYERS = ("core", "sides", "measure", "train", "cli", "workflow")


def _layer(module: str) -> str | None:
    """``rpa.sides.engine`` -> ``sides``; ``rpa.cli.main`` -> ``cli``; ``rpa.__version__`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "rpa" and parts[1] in LAYERS else None


def _imports(path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]  # the layer is its 2nd part
    return [(line, name) for line, name in out if name.split(".")[0] == "rpa"]


def test_every_module_is_in_a_layer_folder():
    loose = sorted(p.name for p in (REPO / "rpa").glob("*.py"))
    assert loose == ["__init__.py", "cli.py"], loose
    assert sorted(p.name for p in (REPO / "rpa").iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted(set(LAYERS) - {"cli"})


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_downward(layer):
    files = [REPO / "rpa/cli.py"] if layer == "cli" else sorted((REPO / "rpa" / layer).rglob("*.py"))
    assert files
    upward = []
    for path in files:
        for line, name in _imports(path):
            target = _layer(name)
            if target is not None and LAYERS.index(target) > LAYERS.index(layer):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """Control: a core module importing the trainer side is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from rpa.sides import trainer\n    from rpa.train.config import RunConfig\n")
    names = [name for _, name in _imports(bad)]
    assert names == ["rpa.sides.trainer", "rpa.train.config.RunConfig"]
    assert {_layer(n) for n in names} == {"sides", "train"}
