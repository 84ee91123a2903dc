"""The suite's shared runner (`python -m benchmarks NAME`): every member's argument parser (`parser`, `parse`:
`--smoke`, `--out`, `--workdir`, `--reuse`, `--timeout`), one `edit-train` job as a subprocess with a one-line
failure, what it wrote (`summary.json`, `metrics.jsonl`, docs/architecture.md §5), JSON records (with the command,
commit and box they came from), plots (matplotlib, Agg) and tables.

`--smoke` runs a member in miniature: its outputs go to a temporary folder (`BENCH_SMOKE_DIR` when set; never
results/), and every `edit-train` job trains in this process at the smallest size (`SMOKE_OVERRIDES`: a tiny model,
one cluster of one rank, two steps), so the default test suite runs every member end to end in seconds.

Benchmarks import this module as ``_common`` (``python benchmarks/<name>.py`` puts this folder on
``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
RUNS_DIR = RESULTS_DIR / "runs"
RECORDS_DIR = BENCH_DIR.parent / "results"  # the committed records and their index (results/README.md)

# Every benchmark job: no W&B, no progress bar, no end-of-run checkpoint (saves time and disk).
BASE_OVERRIDES = ("logger=none", "train.progress=false", "checkpoint.at_end=false")


# --smoke: every job at the smallest size, in this process (one cluster of one rank, two steps, no faults, the
# smallest model of the job's family `SMOKE_MODELS`, a time schedule's interval 0.05 s: A-EDiT's 5 s would be the
# smoke's whole time)
SMOKE_OVERRIDES = ("train.steps=2", "train.batch_size=1", "train.seq_len=16", "train.eval_every=2",
                   "train.eval_batches=1", "train.log_every=1", "train.threads=1", "cluster=local", "cluster.count=1",
                   "cluster.ranks=1", "cluster.slowdown=[]", "faults=[]", "data.split=shared", "algo.sync_time_s=0.05")
SMOKE_MODELS = ("tiny", "tiny_v2")  # a job on another model runs on tiny under --smoke
OUTPUTS = ("out", "plot", "workdir", "out_dir", "outdir", "run_dir")  # the arguments --smoke moves to its folder
SMOKE: Path | None = None  # the smoke's output folder while a member runs with --smoke


def parser(doc: str | None, *, out: str | None = None, plot: str | None = None, workdir: str | None = None,
           reuse: bool = False, timeout: float | None = None) -> argparse.ArgumentParser:
    """A member's argument parser: the first paragraph of its docstring, `--smoke`, and those of the shared options
    it names (`--out RECORD` and `--plot PNG` under results/, `--workdir` under the runs folder, `--reuse`,
    `--timeout` seconds per run)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n", 1)[0])
    ap.add_argument("--smoke", action="store_true", help="run in miniature into a temporary folder (not results/)")
    if out is not None:
        ap.add_argument("--out", type=Path, default=RECORDS_DIR / out)
    if plot is not None:
        ap.add_argument("--plot", type=Path, default=RECORDS_DIR / plot)
    if workdir is not None:
        ap.add_argument("--workdir", type=Path, default=RUNS_DIR / workdir)
    if reuse:
        ap.add_argument("--reuse", action="store_true", help="read a run that already finished with these overrides")
    if timeout is not None:
        ap.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse; under `--smoke` every output argument (`OUTPUTS`) left at its default moves into the smoke's folder."""
    global SMOKE
    args = ap.parse_args(argv)
    SMOKE = None
    if getattr(args, "smoke", False):
        SMOKE = Path(os.environ.get("BENCH_SMOKE_DIR") or tempfile.mkdtemp(prefix="bench-smoke-"))
        SMOKE.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            value = getattr(args, name, None)
            if isinstance(value, (str, Path)) and value == ap.get_default(name):
                setattr(args, name, SMOKE / Path(value).name)
    return args


def smoke_dir(name: str) -> Path:
    """A folder for `name` inside the smoke's folder (a member's own scratch space under --smoke)."""
    assert SMOKE is not None
    path = SMOKE / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class JobError(RuntimeError):
    """An `edit-train` job failed; the message carries the tail of its log."""


@dataclass
class Job:
    """One finished `edit-train` run."""

    name: str
    run_dir: Path
    overrides: list[str]
    wall_s: float  # wall-clock seconds of the whole subprocess (spawn, data, train, eval)
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.metrics if m.get("event") == kind]

    def eval_curve(self) -> tuple[list[int], list[float]]:
        """(steps, val_loss) from the `eval` events, sorted by step."""
        ev = sorted(self.events("eval"), key=lambda e: e["step"])
        return [int(e["step"]) for e in ev], [float(e["val_loss"]) for e in ev]


def edit_train_cmd() -> list[str]:
    """The `edit-train` console script, or the module with this interpreter if it is not on PATH."""
    exe = shutil.which("edit-train")
    return [exe] if exe else [sys.executable, "-m", "edit_train.cli.train"]


def run_job(name: str, run_dir: Path, overrides: Sequence[str], *, timeout: float | None = None,
            verbose: bool = True, reuse: bool = False) -> Job:
    """Run `edit-train <overrides> run.dir=<run_dir>` in a fresh `run_dir`; stdout+stderr go to
    `<run_dir>/job.log`. Raises JobError (with the log's tail) if it fails or writes no summary.
    `reuse=True` returns the run already in `run_dir` instead if it completed with the same overrides."""
    run_dir = Path(run_dir).resolve()
    args = job_args(run_dir, overrides)
    rec = finished_run(run_dir, overrides) if reuse else None
    if rec is not None:
        if verbose:
            print(f"{name}: reusing the finished run in {run_dir}", flush=True)
        return Job(name, run_dir, args, float(rec["wall_s"]), read_summary(run_dir), read_metrics(run_dir))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if SMOKE is not None:
        return smoke_job(name, run_dir, args, verbose)
    cmd = edit_train_cmd() + args
    log_path = run_dir / "job.log"
    if verbose:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: edit-train {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=dict(os.environ), cwd=str(BENCH_DIR.parent))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise JobError(f"{name}: edit-train failed (rc={rc}); log {log_path}:\n{tail}")
    job = Job(name, run_dir, list(args), wall, read_summary(run_dir), read_metrics(run_dir))
    (run_dir / "bench_job.json").write_text(json.dumps({"args": args, "wall_s": wall}))
    if verbose:
        s = job.summary
        print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {wall:.0f}s, val loss "
              f"{s.get('final_val_loss', float('nan')):.4f}, {s.get('cross_cluster_bytes', 0) / 1e6:.1f} MB "
              "cross-cluster", flush=True)
    return job


def smoke_overrides(overrides: Sequence[str]) -> list[str]:
    """A job's overrides at the smoke's size: `SMOKE_OVERRIDES` after them, and a tiny model."""
    models = [x.split("=", 1)[1] for x in overrides if x.startswith("model=")]
    return [*overrides, *([] if models and models[-1] in SMOKE_MODELS else ["model=tiny"]), *SMOKE_OVERRIDES]


def smoke_job(name: str, run_dir: Path, args: list[str], verbose: bool) -> Job:
    """`run_job` under --smoke: the job's overrides, then `SMOKE_OVERRIDES`, trained in this process."""
    from edit_train.cli.common import compose
    from edit_train.config import validate
    from edit_train.train.trainer import train

    smoke = smoke_overrides(args[:-1]) + args[-1:]
    t0 = time.perf_counter()
    with (run_dir / "job.log").open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            cfg = compose(smoke)
            validate(cfg)
            train(cfg)
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"{name}: edit-train (in-process smoke) failed: {type(exc).__name__}: {exc}") from exc
    wall = time.perf_counter() - t0
    (run_dir / "bench_job.json").write_text(json.dumps({"args": smoke, "wall_s": wall}))
    if verbose:
        print(f"{name}: smoke run in {wall:.1f}s", flush=True)
    return Job(name, run_dir, smoke, wall, read_summary(run_dir), read_metrics(run_dir))


def job_args(run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The `edit-train` arguments `run_job` passes (and records in `<run_dir>/bench_job.json`)."""
    return [*BASE_OVERRIDES, *overrides, f"run.dir={Path(run_dir).resolve()}"]


def finished_run(run_dir: Path, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The `bench_job.json` record of a run in `run_dir` that completed with exactly these overrides
    (what `run_job(..., reuse=True)` would reuse), else None."""
    run_dir = Path(run_dir).resolve()
    record = run_dir / "bench_job.json"
    if not (record.exists() and (run_dir / "summary.json").exists()):
        return None
    try:
        rec = json.loads(record.read_text())
    except json.JSONDecodeError:
        return None
    from edit_train.retired import current_override, edit_outer_then, implicit_before

    # a run recorded before a key's rename (edit_train/retired.py) is the same run under today's key, and one recorded
    # before a default changed is the same run as today's that pins the old default (and only that one: an edit run
    # that ran the outer step of before issue 66 is not today's that leaves it to the default by cluster count)
    args = [current_override(x)[0] for x in rec.get("args") or []]
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = None
    want = edit_outer_then(job_args(run_dir, overrides), args, config)
    if want is None:
        return None
    if args == want:
        return rec
    return rec if args == implicit_before(want, args, record.stat().st_mtime) else None


def read_summary(run_dir: Path) -> dict[str, Any]:
    """`summary.json` (a run dir written before the one-word rename read as today's: edit_train/retired.py)."""
    from edit_train.retired import current_summary

    return current_summary(json.loads((Path(run_dir) / "summary.json").read_text()), run_dir)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of `metrics.jsonl` (a torn last line is skipped; old field names read as today's)."""
    from edit_train.retired import current_event

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(current_event(json.loads(line)))
        except json.JSONDecodeError:
            continue
    return out


def tokens_per_step(summary: dict[str, Any]) -> float:
    """Tokens all clusters consume per optimizer step (from the summary)."""
    return summary["tokens"] / max(summary["steps"], 1)


def environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def load() -> dict[str, Any]:
    """How busy this host was (load averages over 1, 5, 15 minutes, and its cores): timings mean little without."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg": [one, five, fifteen], "cpus": os.cpu_count()}


def anchor_check(run_dir: Path) -> tuple[int, list[str], list[str]]:
    """(files checked, non-finite 'file:tensor's, module names) over every cluster's last checkpoint (anchors
    and outer momentum; the run needs `checkpoint.at_end=true`)."""
    from safetensors.torch import load_file

    files = sorted(Path(run_dir).glob("checkpoints/*/step_*/rank*-outer.safetensors")) or sorted(
        Path(run_dir).glob("checkpoints/step_*/rank*-outer.safetensors"))  # a lone cluster (--smoke) has no folder
    if not files:
        raise JobError(f"{run_dir}: no checkpoints/<cluster>/step_*/rank*-outer.safetensors")
    bad, modules = [], set()
    for f in files:
        for key, t in load_file(str(f)).items():
            modules.add(key.rsplit("/", 2)[0])
            if t.is_floating_point() and not bool(t.isfinite().all()):
                bad.append(f"{f.relative_to(run_dir)}:{key}")
    return len(files), bad, sorted(modules)


def ratio(num: float, den: float) -> float:
    """num ÷ den, NaN where den is 0 (a smoke's lone cluster moves no bytes)."""
    return num / den if den else math.nan


def ring_bytes(summary: dict[str, Any], clusters: int) -> float:
    """What one cluster sends in a ring all-reduce of the whole model in fp32: 2(N−1)/N · 4 · parameters."""
    return 2 * (clusters - 1) / clusters * 4 * float(summary["total_params"])


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats -> None, paths -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def provenance() -> dict[str, Any]:
    """Where a record came from: the command that ran (as typed: `python -m benchmarks NAME ...`), the commit
    (with `+dirty` when the tree had changes) and the box."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=BENCH_DIR.parent, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    member = os.environ.get("BENCH_MEMBER")
    argv = ["python", "-m", "benchmarks", member, *sys.argv[1:]] if member else ["python", *sys.argv]
    return {"command": " ".join(argv), "commit": commit,
            "box": f"{platform.node()} · {platform.platform()} · {os.cpu_count()} CPUs"}


def write_json(path: Path, obj: Any) -> Path:
    """Write a result; a dict gets `command`, `commit` and `box` where it has none. A record in results/
    regenerates the index (results/README.md)."""
    path = Path(path)
    if SMOKE is not None and path.resolve().parent == RECORDS_DIR:
        raise RuntimeError(f"--smoke writes no record in results/ ({path})")
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, dict):
        obj = {**{k: v for k, v in provenance().items() if k not in obj}, **obj}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    if path.resolve().parent == RECORDS_DIR and (RECORDS_DIR / "index.py").is_file():
        index = _results_index()
        index.OUT.write_text(index.render())
    return path


def _results_index() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_index", RECORDS_DIR / "index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_fig(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:  # a figure with its own layout (constrained) keeps it
        fig.tight_layout()
    fig.savefig(path, dpi=120 if SMOKE is None else 30)  # a smoke's plot is drawn, not looked at
    pyplot().close(fig)
    return path


def fmt(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (int, float)) and spec:
        return format(v, spec)
    return str(v)


def print_targets(targets: dict[str, Any], out: Path, plot: Path, spec: str = ".4f") -> None:
    """The closing lines every benchmark prints: each target's value, then where the results went."""
    for k, v in targets.items():
        print(f"  {k}: {fmt(v, spec)}")
    print(f"wrote {out} and {plot}")


def table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table. `columns` = (key, header, format spec) triples."""
    rows = list(rows)
    cells = [[h for _, h, _ in columns]] + [[fmt(r.get(k), spec) for k, _, spec in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
