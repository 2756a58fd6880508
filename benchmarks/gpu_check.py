"""One prepared run on a CUDA GPU: every check that needs one, each in its own time box.

On a machine with a CUDA device this makes the project importable (``pip install --no-deps -e .``
where ``import planner`` fails, then only the missing pure-Python dependencies; torch is never
installed), then runs, each as a subprocess with its own timeout:

1. ``cuda_tests``: ``pytest -m cuda -q tests``, every test marked ``cuda``;
2. ``quality``: ``benchmarks/quality.py --device cuda`` on the GPT-2-small-sized model, at
   checkpoint-every-layer's peak, the save-matmuls policy's peak and 50 %, with the user's exact
   computation and, in rows labelled ``planner, masks simplified``, with
   ``simplify_attention_masks=True`` (page ``docs/benchmarks/quality_check_cuda.md``);
3. ``captured_vs_eager``: the captured graph with nothing recomputed (``optimize`` at a roomy
   budget) against the eager model's step time, interleaved repeats, median ratio (page
   ``docs/benchmarks/captured_graph_cuda.md``);
4. ``offload``: ``benchmarks/offload_gpu.py`` on Llama and GPT-2 at the H100 profiles' sizes:
   keeping everything, checkpointing every layer, and the two with saved tensors offloaded to
   pinned host memory (:mod:`rewrite.offload`); then plans made on the GPU at every-layer's
   peak, recompute only and with offload, applied and measured against their predictions (page
   ``docs/benchmarks/offload_cuda.md``, written after each model);
5. ``compile``: ``benchmarks/compile.py --device cuda --quick`` on the 4-layer GPT-2: compiled
   with nothing recomputed, HF every layer then compiled, ``activation_memory_budget`` 0.5, and
   ``optimize(..., compile=True)`` at every layer's measured peak: peaks, graph breaks, step
   times, the same loss (page ``docs/benchmarks/compile_cuda.md``);
6. ``corpus``: ``benchmarks/corpus.py --device cuda --quick`` on a few families (page
   ``docs/benchmarks/corpus_cuda.md``), skipped with its reason where the script is absent;
7. ``pages``: stamps each ``docs/benchmarks/*_cuda.md`` page the steps wrote with the date, the
   GPU's name and the torch version (where the page lacks one of them) and copies it to the
   output folder.

It prints one line per step as it goes, a table of the steps and their times at the end, and
the files written. Each step's standard output and error go to ``<out>/<step>.log``; the
scripts' tables to ``<out>/results/``. The time boxes add up to under 8 minutes on an H100.
Without a CUDA device it prints one line saying so and exits 0.

    python3 benchmarks/gpu_check.py              # or: make gpu-check
    python3 benchmarks/gpu_check.py --dry-run    # the steps and their time boxes; no GPU needed
    python3 benchmarks/gpu_check.py --out DIR    # default: $OUT if set, else benchmarks/results/gpu_check/
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_DIR = ROOT / "docs" / "benchmarks"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check"
#: the most all the time boxes together may take, in seconds
TOTAL_BOX_S = 480
#: the pure-Python dependencies the steps import, by pip name, with the module each provides
PURE_PYTHON_DEPS = {"pulp": "pulp", "pandas": "pandas", "numpy": "numpy", "networkx": "networkx",
                    "highspy": "highspy", "transformers": "transformers", "pytest": "pytest",
                    "pytest-xdist": "xdist", "hypothesis": "hypothesis", "matplotlib": "matplotlib"}
#: the longest any single pip call may take, in seconds
PIP_CALL_S = 60
QUALITY_MODELS = ("gpt2_gpu",)
QUALITY_REPEATS = 5
CAPTURED_MODELS = ("gpt2_gpu", "llama_gpu")
CAPTURED_REPEATS = 9
#: budget for the captured graph with nothing recomputed: more than any of its models' steps hold
ROOMY_BUDGET_GB = 1000.0
COMPILE_MODELS = ("gpt2",)
#: Llama first: its profile takes a third of GPT-2's, so a cut time box still has one planned model
OFFLOAD_MODELS = ("llama", "gpt2")
OFFLOAD_REPEATS = 3
CORPUS_FAMILIES = ("gpt2", "llama", "bert", "vit")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check: a command run as a subprocess, or (``command`` None) work done here."""

    name: str
    box_s: int
    about: str
    command: tuple[str, ...] | None = None
    #: why the step does not run; None: it runs
    skip_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    step: Step
    status: str  # "ok", "FAILED (...)", "TIMED OUT", "skipped"
    seconds: float
    log: Path | None = None
    notes: tuple[str, ...] = ()


def plan_steps(out: Path, python: str = "python3") -> list[Step]:
    """The steps in order, with their time boxes (seconds) and commands."""
    results = str(out / "results")
    corpus = ROOT / "benchmarks" / "corpus.py"
    return [
        Step("setup", 35, "make the project importable: pip install --no-deps -e . where `import planner` "
             "fails, then only the missing pure-Python dependencies (never torch)"),
        Step("cuda_tests", 70, "every test marked cuda",
             (python, "-m", "pytest", "-m", "cuda", "-q", "--continue-on-collection-errors", "tests")),
        Step("quality", 100, "quality on a GPU, the user's exact computation and rows labelled "
             "'planner, masks simplified', page quality_check_cuda.md",
             (python, "benchmarks/quality.py", "--device", "cuda", "--models", *QUALITY_MODELS,
              "--repeats", str(QUALITY_REPEATS), "--simplify-attention-masks", "--name", "quality_check_cuda",
              "--out", results, "--docs")),
        Step("captured_vs_eager", 65, "the captured graph with nothing recomputed against the eager step, "
             "page captured_graph_cuda.md",
             (python, "benchmarks/gpu_check.py", "captured-vs-eager", "--models", *CAPTURED_MODELS,
              "--repeats", str(CAPTURED_REPEATS), "--out", results, "--docs")),
        Step("offload", 65, "saved tensors offloaded to pinned host memory against keep-all and every layer "
             "on GPT-2 and Llama: measured peak, step time, gradients, page offload_cuda.md",
             (python, "benchmarks/offload_gpu.py", "--device", "cuda", "--models", *OFFLOAD_MODELS,
              "--repeats", str(OFFLOAD_REPEATS), "--docs")),
        Step("compile", 90, "optimize(compile=True) at every layer's peak against the compiled anchors on "
             "GPT-2, quick, page compile_cuda.md",
             (python, "benchmarks/compile.py", "--device", "cuda", "--models", *COMPILE_MODELS, "--quick",
              "--out", results, "--docs")),
        Step("corpus", 50, "a few corpus families on the GPU, quick, page corpus_cuda.md",
             (python, "benchmarks/corpus.py", "--device", "cuda", "--families", *CORPUS_FAMILIES, "--quick",
              "--out", results, "--docs"),
             skip_reason=None if corpus.exists() else "benchmarks/corpus.py is not in this tree"),
        Step("pages", 5, "stamp the docs/benchmarks/*_cuda.md pages the steps wrote (date, GPU, torch) "
             "and copy them to the output folder"),
    ]


def print_dry_run(steps: Sequence[Step]) -> None:
    """One line per step, ``[box NNN s] name: what it does``, then the total."""
    for step in steps:
        skipped = f" (skipped: {step.skip_reason})" if step.skip_reason else ""
        print(f"[box {step.box_s:3d} s] {step.name}: {step.about}{skipped}")
        if step.command:
            print(f"              $ {' '.join(step.command)}")
    print(f"total: {sum(s.box_s for s in steps)} s of time boxes (limit {TOTAL_BOX_S} s)")


def cuda_absent_reason() -> str | None:
    """Why the steps cannot run here (torch missing, or no CUDA device), or None where they can."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install is as good as none here
        return f"torch is not importable: {type(exc).__name__}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def default_out() -> Path:
    """``$OUT`` where it is set, else ``benchmarks/results/gpu_check/``."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else DEFAULT_OUT


def _run_pip(args: Sequence[str], timeout_s: float) -> tuple[bool, str]:
    """``python -m pip install ARGS``; retried with ``--break-system-packages`` where the system
    Python refuses installs (PEP 668). Returns success and the output's last line."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    for attempt in (command, [*command, "--break-system-packages"]):
        try:
            done = subprocess.run(attempt, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            return False, f"pip timed out after {max(1.0, timeout_s):.0f} s"
        output = (done.stdout + done.stderr).strip()
        if done.returncode == 0:
            return True, ""
        if "externally-managed-environment" not in output:
            break
    return False, output.splitlines()[-1] if output else f"pip exited {done.returncode}"


def _project_importable(timeout_s: float) -> bool:
    """Whether ``import planner`` works from outside the tree (the project is installed)."""
    with tempfile.TemporaryDirectory() as away:
        try:
            done = subprocess.run([sys.executable, "-c", "import planner, profiling, rewrite"], cwd=away,
                                  capture_output=True, timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def make_importable(deadline: float) -> list[str]:
    """Install the project without its dependencies where it is not importable, then each missing
    pure-Python dependency (``--no-index`` first, then the index). Returns what happened, one
    line each; failures are reported, not raised."""
    notes: list[str] = []
    if not _project_importable(deadline - time.monotonic()):
        ok, why = _run_pip(["--no-deps", "--no-build-isolation", "-e", str(ROOT)], deadline - time.monotonic())
        notes.append("pip install --no-deps -e .: " + ("ok" if ok else f"failed: {why}"))
    for package, module in PURE_PYTHON_DEPS.items():
        if importlib.util.find_spec(module) is not None:
            continue
        remaining = min(PIP_CALL_S, deadline - time.monotonic())
        ok, why = _run_pip(["--no-index", package], remaining / 2)
        if not ok:
            ok, why = _run_pip(["--retries", "0", "--timeout", "10", package], deadline - time.monotonic())
        notes.append(f"pip install {package}: " + ("ok" if ok else f"failed: {why}"))
    return notes


def run_command(step: Step, log: Path) -> tuple[str, float]:
    """Run ``step.command`` from the repository root in its own process group, output to ``log``;
    the whole group is killed at the time box. Returns the status and the seconds taken."""
    assert step.command is not None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(step.command)}\n")
        sink.flush()
        process = subprocess.Popen(step.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=step.box_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "TIMED OUT", time.monotonic() - started
    return ("ok" if rc == 0 else f"FAILED (rc={rc})"), time.monotonic() - started


def stamp_page(path: Path, gpu: str, torch_version: str, day: str) -> bool:
    """Add a line under the page's title naming the date, GPU and torch version where the page
    lacks any of them. Returns whether the page changed."""
    text = path.read_text()
    if all(piece in text for piece in (gpu, torch_version, day)):
        return False
    title, _, rest = text.partition("\n")
    path.write_text(f"{title}\n\nChecked by `make gpu-check` on {day}: {gpu}, torch {torch_version}.\n{rest}")
    return True


def publish_pages(since: float, out: Path) -> list[str]:
    """Stamp the ``docs/benchmarks/*_cuda.md`` pages written since ``since`` (a ``time.time()``)
    and copy them to ``out/docs/benchmarks/``. Returns one note per page."""
    import torch

    gpu, day = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    copies = out / "docs" / "benchmarks"
    notes = []
    for page in pages_since(since):
        stamped = stamp_page(page, gpu, torch.__version__, day)
        copies.mkdir(parents=True, exist_ok=True)
        shutil.copy2(page, copies / page.name)
        notes.append(f"{page.relative_to(ROOT)}{' (stamped)' if stamped else ''}")
    return notes or ["no *_cuda.md page was written"]


def run_step(step: Step, out: Path, since: float) -> Outcome:
    """Run one step, printing its line as it goes."""
    print(f"[step] {step.name} ...", end=" ", flush=True)
    if step.skip_reason:
        print(f"skipped: {step.skip_reason}", flush=True)
        return Outcome(step, "skipped", 0.0)
    started = time.monotonic()
    log, notes = None, ()
    try:
        if step.command is not None:
            log = out / f"{step.name}.log"
            status, seconds = run_command(step, log)
        else:
            notes = tuple(make_importable(started + step.box_s) if step.name == "setup" else publish_pages(since, out))
            seconds = time.monotonic() - started
            failed = sum(": failed" in note for note in notes)
            status = f"FAILED ({failed} of {len(notes)})" if failed else "ok"
    except Exception as exc:  # noqa: BLE001 - one step's failure must not stop the others
        status, seconds, notes = "FAILED (error)", time.monotonic() - started, (f"{type(exc).__name__}: {exc}",)
    verb = f"after {seconds:.1f} s" if status == "TIMED OUT" else f"in {seconds:.1f} s"
    print(f"{status} {verb}", flush=True)
    for note in notes:
        print(f"       {note}", flush=True)
    return Outcome(step, status, seconds, log, notes)


def pages_since(since: float) -> list[Path]:
    """The ``docs/benchmarks/*_cuda.md`` pages written since ``since`` (a ``time.time()``)."""
    return [page for page in sorted(DOCS_DIR.glob("*_cuda.md")) if page.stat().st_mtime >= since]


def summary(outcomes: Sequence[Outcome], out: Path, since: float) -> str:
    """The table of steps and times, then the files written under ``out`` and ``docs/benchmarks``
    since ``since``."""
    lines = ["| step | status | seconds | time box |", "|---|---|---|---|"]
    lines += [f"| {o.step.name} | {o.status} | {o.seconds:.1f} | {o.step.box_s} |" for o in outcomes]
    lines.append(f"| total | | {sum(o.seconds for o in outcomes):.1f} | {sum(o.step.box_s for o in outcomes)} |")
    written = sorted(p for p in out.rglob("*") if p.is_file() and p.stat().st_mtime >= since) + pages_since(since)
    lines += ["", "Files written:", *(f"- {p}" for p in written)]
    return "\n".join(lines) + "\n"


def run_all(out: Path) -> int:
    """Every step in turn; 0 when all ran (or were skipped with a reason), else 1."""
    out.mkdir(parents=True, exist_ok=True)
    since = time.time()
    outcomes = [run_step(step, out, since) for step in plan_steps(out, sys.executable)]
    text = summary(outcomes, out, since)
    (out / "summary.md").write_text(text)
    print()
    print(text, end="")
    print(f"- {out / 'summary.md'}")
    return 0 if all(o.status.startswith("ok") or o.status == "skipped" for o in outcomes) else 1


def captured_vs_eager(models: Sequence[str], repeats: int, out: Path, docs: bool, device_name: str = "cuda") -> None:
    """Step time of ``optimize`` at a roomy budget (the captured graph, nothing recomputed) over
    the eager model's, interleaved repeats, median; a table to ``out`` and, with ``docs``, the page
    ``docs/benchmarks/captured_graph_cuda.md``."""
    import statistics

    import torch
    from common import publish_table, step_seconds, step_time_ratios, to_device
    from quality import ALL_MODELS

    from planner import optimize
    from profiling import StepInputs

    device = torch.device(device_name)
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    lines = [f"{where}, torch {torch.__version__}, {repeats} interleaved "
             f"timing repeats, {datetime.date.today().isoformat()}.", "",
             "| model | eager step | captured graph / eager | capture | segments recomputed | computation changes |",
             "|---|---|---|---|---|---|"]
    for name in models:
        model, example = to_device(*ALL_MODELS[name][1](), device)
        inputs = StepInputs.from_example(example)
        opt = optimize(model, example, budget_gb=ROOMY_BUDGET_GB)
        ratios = step_time_ratios([model, opt], inputs, repeats, device)
        eager_ms = 1000 * statistics.median(step_seconds(model, inputs, device) for _ in range(3))
        changes = ", ".join(opt.plan.computation_changes) or "none"
        lines.append(f"| {name} | {eager_ms:.1f} ms | {ratios[1]:.3f}x | {opt.plan.capture} "
                     f"| {len(opt.plan.segments)} | {changes} |")
        del model, opt, inputs, example
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines += ["", "Models: " + "; ".join(f"**{n}**: {ALL_MODELS[n][0]}" for n in models) + "."]
    about = ("The captured graph is `optimize(model, example, budget_gb=1000)`: a budget above the step's "
             "peak, so no segment is recomputed and the step runs the captured graph as it is. Its step "
             "time is a ratio to the eager model's step (CUDA events, interleaved repeats, median); 1.00x "
             "means capture costs nothing.")
    doc = {"name": "captured_graph_cuda", "title": "The captured graph against the eager model on a GPU",
           "about": about} if docs else None
    publish_table("\n".join(lines) + "\n", out, "captured_graph_cuda.md", doc=doc)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="list the steps and their time boxes, run nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="logs, tables and page copies (default: $OUT if set, else benchmarks/results/gpu_check/)")
    commands = parser.add_subparsers(dest="command")
    captured = commands.add_parser("captured-vs-eager", help="step 3 alone: the captured graph against eager")
    captured.add_argument("--models", nargs="+", default=list(CAPTURED_MODELS))
    captured.add_argument("--repeats", type=int, default=CAPTURED_REPEATS)
    captured.add_argument("--out", type=Path, default=DEFAULT_OUT / "results")
    captured.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: to try it on small models")
    captured.add_argument("--docs", action="store_true", help="also write docs/benchmarks/captured_graph_cuda.md")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "captured-vs-eager":
        captured_vs_eager(args.models, args.repeats, args.out, args.docs and args.device == "cuda", args.device)
        return 0
    out = args.out or default_out()
    steps = plan_steps(out)
    if args.dry_run:
        print_dry_run(steps)
        return 0
    reason = cuda_absent_reason()
    if reason is not None:
        print(f"gpu-check: no CUDA GPU here ({reason}); on a GPU it would run "
              f"{', '.join(s.name for s in steps)} in at most {sum(s.box_s for s in steps)} s "
              f"(--dry-run lists them)")
        return 0
    return run_all(out)


if __name__ == "__main__":
    sys.exit(main())
