"""The fenced code blocks of the docs pages and what each is marked to be, for the tests that run
them (tests/e2e/test_docs_commands.py) and check their marks (tests/unit/test_docs_site.py).

A shell or Python block is preceded, on the line above its fence, by one mark:
- `<!-- runnable -->`: run against one `make run` stack, and fails the suite when it fails;
- `<!-- settings -->`: `make run VAR=value ...` lines, each checked against the settings
  `make run` reads and the values it accepts (starting a stack a line would take minutes);
- `<!-- skip: REASON -->`: cannot run here (a cluster, a GPU, minutes of CPU); the test shows
  REASON.
Blocks of other languages (diagrams, trees, configs) carry no mark and are not run."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

DOCS = pathlib.Path(__file__).resolve().parents[1]
RUN_LANGUAGES = ("sh", "bash", "shell", "python")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(runnable|settings|skip)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    mark: str | None  # runnable | settings | skip | None
    reason: str = ""  # a skip's

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(text: str, page: str) -> list[Block]:
    found, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = _MARK.match(lines[i - 1]) if i else None
        found.append(
            Block(
                page,
                i + 1,
                fence.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                mark.group(1) if mark else None,
                (mark.group(2) or "") if mark else "",
            )
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [
        block
        for path in sorted(DOCS.glob("*.md"))
        for block in blocks_of(path.read_text(), path.name)
    ]
