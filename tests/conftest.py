import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples", ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs two workers on this 2-core machine), each worker
    runs torch on one thread, so the workers do not fight over the cores. ``optimize``'s profile
    cache (``cache_dir="auto"``) goes to a folder of this process's own, removed at exit, so the
    tests use the default path without reading or filling the user's cache."""
    import atexit
    import os
    import shutil
    import tempfile

    from profiling.cache import CACHE_DIR_ENV

    folder = tempfile.mkdtemp(prefix="ckpt-planner-test-cache-")
    os.environ[CACHE_DIR_ENV] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _report_an_abandoned_highs_solve():
    """A HiGHS solve stuck past its time limit (:mod:`planner.milp.highs`) is abandoned and its thread
    keeps a core busy for the rest of the worker, slowing every later test: say which test hit
    it, as a warning in the summary."""
    from planner.milp.highs import PlannerHiGHS

    before = len(PlannerHiGHS.abandoned)
    yield
    for what in PlannerHiGHS.abandoned[before:]:
        warnings.warn(f"{what}; HiGHS is off for the rest of this test worker", RuntimeWarning, stacklevel=1)
