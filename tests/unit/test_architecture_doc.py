"""docs/architecture.md names files a newcomer will open: each must exist, so the page cannot
drift from the tree unnoticed (its import rules are enforced by tests/unit/test_layering.py)."""

import pathlib
import re

from deploy.processes import REPO_ROOT

GENERATED = {"tandem/v1"}  # made by `make proto`


def _named_paths(text: str) -> list[str]:
    """Backticked paths with a folder in them (`services/worker/servicer.py`, `engine/`)."""
    names = []
    for token in re.findall(r"`([^`\s]+)`", text):
        path = token.split("(")[0]
        if "/" in path and not path.startswith("/"):
            names.append(path.rstrip("/"))
    return names


def test_every_path_on_the_architecture_page_exists():
    root = pathlib.Path(REPO_ROOT)
    named = _named_paths((root / "docs" / "architecture.md").read_text())
    assert len(named) > 30  # the page walks a request through the files
    missing = [p for p in named if p not in GENERATED and not (root / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_scan_reads_paths_not_code():
    text = "`engine/llm_engine.py` `add` `AddRequest(kv=FromPrefill(...))` `engine/` `/v1/chat/completions`"
    assert _named_paths(text) == ["engine/llm_engine.py", "engine"]
