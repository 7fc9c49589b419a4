"""The docs site (mkdocs.yml, docs/): it builds with --strict (a broken link, anchor or page left
out of the nav fails), its models tables are the engine's own lists, every shell and Python
block carries a mark (runnable, settings, or skip with a reason), every `make run` settings line
names settings `make run` reads with values it accepts, and the README's commands are the docs'
(so the docs tests run them too)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from deploy.processes import REPO_ROOT
from deploy.run_settings import refusal
from docs.tools import blocks, models_table


def test_the_site_builds_strict(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "models" / "index.html").is_file()


def test_the_models_page_is_the_engines_lists():
    page = models_table.PAGE.read_text()
    assert models_table.generated_part(page) == models_table.render(), (
        "docs/models.md differs from the engine's lists: run `python docs/tools/models_table.py`"
    )


def test_every_shell_and_python_block_is_marked():
    found = blocks.all_blocks()
    unmarked = [b.name for b in found if b.language in blocks.RUN_LANGUAGES and b.mark is None]
    assert not unmarked, f"blocks with no runnable / settings / skip mark: {unmarked}"
    assert all(b.reason for b in found if b.mark == "skip"), "a skip says why"
    assert sum(b.mark == "runnable" for b in found) >= 10


def _launch_settings() -> set[str]:
    """The environment variables deploy/launch.py reads."""
    source = open(os.path.join(REPO_ROOT, "deploy", "launch.py")).read()
    return set(re.findall(r'"([A-Z][A-Z0-9_]+)"', source))


def test_every_make_run_settings_line_is_one_make_run_accepts():
    known = _launch_settings()
    lines = [
        line.split("#")[0].strip()
        for b in blocks.all_blocks()
        if b.mark == "settings"
        for line in b.code.splitlines()
        if line.startswith("make run")
    ]
    assert len(lines) > 15
    for line in lines:
        settings = dict(word.split("=", 1) for word in shlex.split(line)[2:])
        assert set(settings) <= known, f"{line}: make run reads no {set(settings) - known}"
        assert refusal(settings) is None, f"{line}: {refusal(settings)}"


def test_the_readmes_commands_are_the_docs():
    readme = blocks.blocks_of(open(os.path.join(REPO_ROOT, "README.md")).read(), "README.md")
    docs = {b.code for b in blocks.all_blocks()}
    commands = [b for b in readme if b.language in blocks.RUN_LANGUAGES]
    assert len(commands) == 3
    missing = [b.name for b in commands[1:] if b.code not in docs]  # the first: make run, make test
    assert not missing, f"README blocks the docs do not have (and so do not run): {missing}"
    assert len(open(os.path.join(REPO_ROOT, "README.md")).read().splitlines()) <= 150
