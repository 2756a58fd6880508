"""``benchmarks/gpu_check.py`` (``make gpu-check``) without a GPU: ``--dry-run`` lists every step
with a time box, the boxes fit one H100 session, and a plain run on a machine without CUDA says
so in one line and exits 0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
STEPS = ["setup", "cuda_tests", "quality", "captured_vs_eager", "offload", "compile", "corpus", "pages"]
BOX = re.compile(r"^\[box\s+(\d+) s\] (\w+): ")


def _run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=SCRIPT.parents[1])


def test_dry_run_lists_every_step_with_a_time_box_under_eight_minutes(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    boxes = {m.group(2): int(m.group(1)) for m in map(BOX.match, done.stdout.splitlines()) if m}
    assert list(boxes) == STEPS
    assert all(box > 0 for box in boxes.values())
    assert sum(boxes.values()) <= 480
    assert f"total: {sum(boxes.values())} s" in done.stdout
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="a plain run on a GPU runs the whole check")
def test_plain_run_without_cuda_prints_one_line_and_exits_0(tmp_path):
    done = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], done.stdout
    assert all(step in lines[0] for step in STEPS)
    assert not any(tmp_path.iterdir())
