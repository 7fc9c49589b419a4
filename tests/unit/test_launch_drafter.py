"""`make run SPECULATIVE=eagle3` finds a model's own EAGLE-3 head beside the folder the model is
read from (for a GGUF model, its companion folder in the cache, where `make draft-model
MODEL=...` builds it), and says how to build one where there is none."""

from __future__ import annotations

import pytest

from deploy.launch import REPO_ROOT, drafter_folder
from engine.gguf.folder import head_folder


@pytest.fixture(autouse=True)
def no_draft_model(monkeypatch):
    monkeypatch.delenv("DRAFT_MODEL", raising=False)


def test_a_gguf_models_head_sits_beside_its_companion_folder(tmp_path):
    companion = tmp_path / "gguf" / "5c1906da8970a1b6" / "SmolLM2-135M-Instruct.Q4_1"
    assert head_folder(str(companion) + "/") == f"{companion}-eagle3"
    (tmp_path / "gguf" / "5c1906da8970a1b6" / "SmolLM2-135M-Instruct.Q4_1-eagle3").mkdir(
        parents=True
    )
    assert drafter_folder("eagle3", "smollm2", str(companion), False) == (f"{companion}-eagle3", "")


def test_without_a_head_make_run_says_how_to_build_one(tmp_path):
    folder, refused = drafter_folder("eagle3", "smollm2", str(tmp_path / "model"), False)
    assert folder == ""
    assert "make draft-model MODEL=smollm2" in refused and "DRAFT_MODEL" in refused


def test_draft_model_given_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFT_MODEL", "/heads/published")
    (tmp_path / "model-eagle3").mkdir()
    assert drafter_folder("eagle3", "m", str(tmp_path / "model"), False) == ("/heads/published", "")


def test_the_demo_keeps_its_own_drafters():
    for method, name in (("draft", "tandem-demo-draft"), ("eagle3", "tandem-demo-eagle3")):
        folder, refused = drafter_folder(
            method, "tandem-demo", f"{REPO_ROOT}/demo/tandem-demo", True
        )
        assert folder == f"{REPO_ROOT}/demo/{name}" and not refused
    assert drafter_folder("ngram", "smollm2", "/any", False) == ("", "")
    assert "DRAFT_MODEL" in drafter_folder("draft", "smollm2", "/any", False)[1]
