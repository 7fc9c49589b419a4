"""No code edits the import path: the repository root is on the virtualenv's path once (make
install's editable install), the generated gRPC code is the package tandem.v1 there, so every
import names its module plainly and means the same in a script, a service and a test."""

import re
import subprocess

from deploy.processes import REPO_ROOT

PATH_EDIT = re.compile(
    r"\bsys\.path\s*(\.(insert|append|extend|remove)\b|\[[^\]]*\]\s*=|\+=|=[^=])"
)


def test_no_file_edits_sys_path():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    offenders = []
    for path in files:
        if path == "tests/unit/test_no_path_edits.py":  # its examples below
            continue
        with open(f"{REPO_ROOT}/{path}") as f:
            offenders += [f"{path}:{i}" for i, line in enumerate(f, 1) if PATH_EDIT.search(line)]
    assert not offenders, f"sys.path edited at {offenders}"


def test_the_pattern_catches_each_kind_of_edit():
    for line in (
        "sys.path.insert(0, ROOT)",
        "sys.path.append(x)",
        "sys.path += [x]",
        "sys.path[:0] = [x]",
        "sys.path = [x]",
    ):
        assert PATH_EDIT.search(line), line
    assert not PATH_EDIT.search("if sys.path == old:")
