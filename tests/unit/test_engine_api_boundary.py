"""Services use the engine through its public API only (issue 25, acceptance 1): every attribute
a file under services/ reads off the engine object is in ENGINE_API, and every one it reads off
the engine's KV connector is the connector's contract (engine/kv_connector.py's KVConnector).

The engine object is whatever a service names `engine`, `eng` or `_engine`, bare or as an
attribute (`self.engine`, `loop.engine`, `self.state.loop.engine`), except a config's `engine`
field (the EngineConfig a worker's config carries). The connector is `<engine>.kv`, and
whatever a file assigns it to (`self.kv = loop.engine.kv`).
"""

from __future__ import annotations

import ast
import os
import textwrap

from engine.kv_connector import KVConnector

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = os.path.join(REPO, "services")

ENGINE_API = {
    "add",  # an engine.requests.AddRequest, with where its KV comes from
    "step",
    "abort",
    "abort_all",
    "has_unfinished_requests",
    "stats",  # engine.outputs.EngineStats
    "kv",  # the KV connector, with its layout
    "attach_drafter",  # a remote drafter (the draft service)
    "dead_ranks",
    "close",
}
CONNECTOR_API = {name for name in vars(KVConnector) if not name.startswith("_")} | {"layout"}
ENGINE_NAMES = {"engine", "eng", "_engine"}


def _is_engine(node: ast.AST, config_class: bool) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    if isinstance(node, ast.Attribute) and node.attr in ENGINE_NAMES:
        base = node.value
        if isinstance(base, ast.Name) and (
            base.id == "config" or (base.id == "self" and config_class)
        ):
            return False  # a worker config's EngineConfig field, not the engine
        return True
    return False


def violations(source: str, filename: str = "<snippet>") -> list[str]:
    """`file:line: engine.attr` for each access outside the public API."""
    tree = ast.parse(source)
    # lines inside classes named *Config, where self.engine is a config
    config_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            config_lines |= set(range(node.lineno, (node.end_lineno or node.lineno) + 1))

    def engine(node: ast.AST) -> bool:
        return _is_engine(node, getattr(node, "lineno", 0) in config_lines)

    def connector_of(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "kv" and engine(node.value)

    aliases = {
        ast.unparse(target)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and connector_of(node.value)
        for target in node.targets
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if engine(node.value) and node.attr not in ENGINE_API:
                found.append(f"{filename}:{node.lineno}: engine.{node.attr}")
            elif (
                connector_of(node.value) or ast.unparse(node.value) in aliases
            ) and node.attr not in CONNECTOR_API:
                found.append(f"{filename}:{node.lineno}: engine.kv.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr")
        ):
            if node.args and engine(node.args[0]):
                found.append(f"{filename}:{node.lineno}: {node.func.id}(engine, ...)")
    return found


def service_files() -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(SERVICES)
        for name in names
        if name.endswith(".py")
    )


def test_services_touch_only_the_engines_public_api():
    found = []
    for path in service_files():
        with open(path) as f:
            found += violations(f.read(), os.path.relpath(path, REPO))
    assert not found, "services reach into the engine:\n" + "\n".join(found)


def test_the_check_sees_each_way_a_service_can_reach_in():
    snippet = textwrap.dedent("""
        class Servicer:
            def health(self):
                return self.state.loop.engine.scheduler.running, self.engine.block_manager

            def pool(self, loop):
                self.kv = loop.engine.kv
                return self.kv.kv_cache, loop.engine.kv.block_manager

        def main(engine, _engine):
            engine.speculator.drafter = None
            getattr(engine, "seqs")
            return _engine.config
    """)
    assert sorted(v.split(": ", 1)[1] for v in violations(snippet)) == sorted(
        [
            "engine.scheduler",
            "engine.block_manager",
            "engine.kv.kv_cache",
            "engine.kv.block_manager",
            "engine.speculator",
            "getattr(engine, ...)",
            "engine.config",
        ]
    )


def test_the_public_api_and_a_configs_engine_field_pass():
    snippet = textwrap.dedent("""
        class WorkerConfig:
            def role(self):
                return self.engine.role

        class Loop:
            def run(self, request):
                self.kv = self.engine.kv
                self.engine.add(request)
                self.kv.reserve(3, [])
                return self.engine.stats().num_running, self.engine.kv.layout.block_size, config.engine.model
    """)
    assert violations(snippet) == []
