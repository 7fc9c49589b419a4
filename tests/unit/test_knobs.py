"""Every TANDEM_* environment variable is read in one place: the engine's process-wide knobs in
engine/knobs.py, a service's settings by its config fields (services/settings.py reads each
field's `env`), and the fault tests' TANDEM_FAULTS in services/faults.py."""

import ast
import pathlib

import pytest

from deploy.processes import REPO_ROOT
from engine import knobs

READERS = {"engine/knobs.py", "services/faults.py"}


def _environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each os.environ.get("TANDEM_..."), os.environ["TANDEM_..."], os.getenv(...)."""
    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "os.environ.setdefault", "os.environ.pop"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        if isinstance(key, ast.Constant) and str(key.value).startswith("TANDEM_"):
            reads.append((node.lineno, key.value))
    return reads


def test_tandem_variables_are_read_only_in_their_one_place():
    root = pathlib.Path(REPO_ROOT)
    found = []
    for folder in ("engine", "services"):
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name not in READERS:
                found += [
                    f"{name}:{line} {key}"
                    for line, key in _environ_reads(ast.parse(path.read_text()))
                ]
    assert not found, f"TANDEM_* read outside engine/knobs.py and the config fields: {found}"


def test_the_scan_sees_each_way_of_reading():
    code = 'os.environ.get("TANDEM_A")\nos.environ["TANDEM_B"]\nos.getenv("TANDEM_C", "1")\nos.environ.get("HOME")'
    assert [key for _, key in _environ_reads(ast.parse(code))] == [
        "TANDEM_A",
        "TANDEM_B",
        "TANDEM_C",
    ]


def test_a_bad_kernels_setting_names_the_choices(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", "fastest")
    with pytest.raises(ValueError, match="'fastest': expected one of invariant, measured"):
        knobs.kernels()
