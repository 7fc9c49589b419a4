"""Matmul kernel choice: every kernel a Linear may pick computes the same product, measured
choices are cached per machine and read back by other processes without measuring, and
buckets cover every row count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.layers import kernel_choice
from engine.layers.kernel_choice import BUCKET_ROWS, Choice, KernelChoices, bucket_of
from engine.layers.linear import Linear


def test_buckets_cover_every_row_count_and_time_each_at_its_top():
    assert [bucket_of(n) for n in (1, 2, 4, 5, 16, 17, 64, 65, 10_000)] == [
        0,
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]
    assert all(bucket_of(rows) == b for b, rows in enumerate(BUCKET_ROWS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["invariant", "plain", "onednn", "widen"])
def test_every_kernel_computes_the_product(monkeypatch, dtype, kernel):
    weight, bias = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    choice = Choice((kernel,) * len(BUCKET_ROWS), 16 if kernel == "onednn" else 0)
    monkeypatch.setattr(KernelChoices, "for_weight", lambda self, w: choice)
    linear = Linear(weight, bias)
    for rows in (1, 3, 16, 100):
        x = torch.randn(rows, 64).to(dtype)
        expected = F.linear(x.float(), weight.float(), bias.float())
        tol = 1e-4 if dtype is torch.float32 else 3e-2
        torch.testing.assert_close(linear(x).float(), expected, rtol=tol, atol=tol * 8)


def test_a_measured_choice_is_cached_and_read_by_another_process_without_measuring(
    tmp_path, monkeypatch
):
    path = tmp_path / "kernels.json"
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(path))
    monkeypatch.setenv("TANDEM_KERNELS", "measured")
    choice = KernelChoices().for_weight(torch.randn(48, 32))
    assert len(choice.kernels) == len(BUCKET_ROWS)
    assert set(choice.kernels) <= {"plain", "onednn"} and (choice.pack_hint > 0) == (
        "onednn" in choice.kernels
    )
    stored = json.loads(path.read_text())
    assert Choice.from_json(stored["float32 48x32"]) == choice

    # Another process reads it (a measurement there would fail).
    code = (
        "import torch; from engine.layers import kernel_choice as kc\n"
        "kc.measure = lambda w: (_ for _ in ()).throw(AssertionError('measured again'))\n"
        "print(kc.KernelChoices().for_weight(torch.randn(48, 32)).kernels)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={
            **__import__("os").environ,
            "TANDEM_KERNEL_CACHE": str(path),
            "TANDEM_KERNELS": "measured",
        },
    ).stdout
    assert out.strip() == str(choice.kernels)


def test_remeasure_replaces_a_cached_choice_and_forced_kernels_skip_measuring(
    tmp_path, monkeypatch
):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"float32 48x32": {"kernels": ["widen"] * 5, "pack_hint": 0}}))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(path))
    monkeypatch.setenv("TANDEM_KERNELS", "plain")
    monkeypatch.setattr(
        kernel_choice, "measure", lambda w: pytest.fail("measured with TANDEM_KERNELS=plain")
    )
    assert KernelChoices().for_weight(torch.randn(48, 32)).kernels == ("plain",) * 5
    monkeypatch.setenv("TANDEM_KERNELS", "measured")
    # the cached one
    assert KernelChoices().for_weight(torch.randn(48, 32)).kernels == ("widen",) * 5
    measured = Choice(("onednn",) * 5, 16)
    monkeypatch.setattr(kernel_choice, "measure", lambda w: (measured, 1.0))
    monkeypatch.setenv("TANDEM_KERNELS", "remeasure")
    assert KernelChoices().for_weight(torch.randn(48, 32)) == measured
    assert Choice.from_json(json.loads(path.read_text())["float32 48x32"]) == measured


def test_the_default_is_the_batch_invariant_kernel_and_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.delenv("TANDEM_KERNELS", raising=False)
    monkeypatch.setattr(kernel_choice, "measure", lambda w: pytest.fail("the default measured"))
    assert KernelChoices().for_weight(torch.randn(48, 32)).kernels == ("invariant",) * 5
    assert KernelChoices().for_weight(torch.randn(48, 32).bfloat16()).kernels == ("invariant",) * 5
    monkeypatch.setenv("TANDEM_KERNELS", "fastest")
    with pytest.raises(
        ValueError, match="TANDEM_KERNELS='fastest': expected one of invariant, measured"
    ):
        KernelChoices().for_weight(torch.randn(48, 32))
