"""Who may import whom (docs/architecture.md): the engine knows no services; the gateway
reads only the engine's torch-free model files (tokenizer, config, block hashes) and no worker;
the KV store and the transports know no engine; nothing imports the launcher. A new import
across these lines is a design change: change the table with it."""

import ast
import pathlib

from deploy.processes import REPO_ROOT

# component (a folder) -> the modules of other components it may import (prefixes).
COMMON = (
    "services.lifecycle",
    "services.settings",
    "services.tracing",
    "services.faults",
    "services.failed_peer",
    "services.event_log",
    "tandem.v1",
)
ALLOWED = {
    "engine": (),
    # services.kvcache.mooncake_pool: a Mooncake pool's address and key format (torch-free).
    "services.gateway": (
        "engine.tokenizer",
        "engine.o200k",
        "engine.config",
        "engine.gguf.folder",
        "engine.block_hash",
        "services.kvcache.mooncake_pool",
        *COMMON,
    ),
    # engine.progress: stdlib only, the warm start's progress line.
    "services.kvcache": ("services.kvtransfer", "engine.progress", *COMMON),
    "services.kvtransfer": COMMON,
    "services.worker": (
        "engine",
        "services.decode",
        "services.kvcache.keys",
        "services.kvcache.mooncake_pool",
        "services.kvtransfer",
        *COMMON,
    ),
    "services.prefill": ("engine", "services.worker", "services.kvtransfer", *COMMON),
    "services.decode": ("engine", "services.worker", "services.kvtransfer", *COMMON),
    "services.draft": ("engine", *COMMON),
}
OURS = ("engine", "services", "deploy", "bench", "demo", "tandem", "tests")


def _component(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" else parts[0]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from services import lifecycle` imports services.lifecycle
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in OURS]


def _violations(component: str, path: str, tree: ast.AST) -> list[str]:
    allowed = ALLOWED[component]
    return [
        f"{path}:{line} imports {name}"
        for line, name in _imports(tree)
        if _component(name) != component
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]


def test_each_component_imports_only_what_its_layer_allows():
    root = pathlib.Path(REPO_ROOT)
    found = []
    for component in ALLOWED:
        for path in sorted((root / component.replace(".", "/")).rglob("*.py")):
            found += _violations(
                component, path.relative_to(root).as_posix(), ast.parse(path.read_text())
            )
    assert not found, "imports across the layers (tests/unit/test_layering.py):\n" + "\n".join(
        found
    )


def test_a_crossing_import_is_found():
    tree = ast.parse(
        "from services.worker.engine_loop import EngineLoop\nimport engine.llm_engine\n"
        "from engine.tokenizer import Tokenizer\n"
    )
    assert _violations("services.gateway", "x.py", tree) == [
        "x.py:1 imports services.worker.engine_loop.EngineLoop",
        "x.py:2 imports engine.llm_engine",
    ]
