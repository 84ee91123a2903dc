"""What `edit-train` checks before anything is written, and what its exit paths say.

* `check_run_dir`: `run.dir` must be a directory we may create, and must not already hold a run unless
  `resume` asks to continue it (a second run would append to its metrics.jsonl and overwrite its checkpoints).
  A whole run (a lone cluster, or the local launcher with every cluster) looks at everything in run.dir; a
  cluster job (`cluster.only=X` or `EDIT_TRAIN_CLUSTER=X`, by hand, torchrun or Slurm) at X's traces only.
* `check_run_lock`: no cluster this invocation starts may be being written by another process
  (`clusters/<name>.lock`, edit_train/train/runlock.py): refused in one line naming its PID and host.
* `RunDirGuard`: a run directory this invocation created is removed again when the run fails before writing
  anything into it (Hydra creates `run.dir` before the task runs).
* `relaunched`: a cluster job started again over its own run continues it (`resume=auto`, one line).
* `own_config`: a resume continues the run's own configuration (train/run_config.py); an override that changes
  it is refused in one line naming the keys, an allowed change (its length, …) is said in one line.
* `nothing_left`: a finished run, or a cluster whose federation finished without it, exits 0 in one line.
* `interrupted_message`: what Ctrl-C leaves behind, said truthfully (a checkpoint exists or it does not).
* `fail_once`: under torchrun every rank hits the same config/topology error; only rank 0 says it.
* `adopt_tokenizer_vocab`: `model.vocab_size` follows the tokenizer unless it was set explicitly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from edit_train.cli.common import fail

log = logging.getLogger(__name__)

# What a run writes into run.dir (docs/architecture.md §5); any of them means the directory holds a run.
RUN_ARTIFACTS = ("summary.json", "metrics.jsonl", "checkpoints", "config.json")
# Written by the local launcher before any worker starts: not a run's output.
SCAFFOLDING = frozenset({"launch_config.json"})
LOCKS = "clusters"  # clusters/<name>.lock (train/runlock.py): a run's lock files are not its output either
_STEP_DIR = re.compile(r"step_(\d+)$")


class RunDirError(ValueError):
    """`run.dir` cannot be used as given; the message names it and says what to do."""


def _torchrun_rank() -> int | None:
    """This process's rank when it is one of several torchrun workers, else None."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ.get("RANK", "0"))
    return None


def cut_short(exc: BaseException) -> bool:
    """An error raised while a Ctrl-C unwound the code (a `finally` or an `except` that failed on the state the
    interrupt left half-built, e.g. OmegaConf's `'NoneType' object has no attribute '_invalidate_flags_cache'`):
    the interrupt is what happened, not a user error to print."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def fail_once(message: str, code: int = 2) -> NoReturn:
    """`fail`, said by rank 0 only: the other torchrun workers hit the same error and exit with the same code."""
    rank = _torchrun_rank()
    if rank:  # not None and not 0
        raise SystemExit(code)
    fail(message, code)


def _restarted() -> bool:
    """A worker restarted by torchrun / the local launcher always resumes (see the trainer)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _holds_run(run_dir: Path) -> str | None:
    """Which run artifact `run_dir` holds ('summary.json', …), or None."""
    for name in RUN_ARTIFACTS:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            return name
    return None


def job_cluster(cfg: Any) -> str | None:
    """The one cluster this job trains (EDIT_TRAIN_CLUSTER or cluster.only), or None for a whole run."""
    return os.environ.get("EDIT_TRAIN_CLUSTER") or getattr(cfg.cluster, "only", "") or None


def job_clusters(cfg: Any) -> list[str]:
    """The clusters this invocation starts: a cluster job its own, a whole run every configured one."""
    from edit_train.config import cluster_specs

    name = job_cluster(cfg)
    return [name] if name else [s.name for s in cluster_specs(cfg)]


def check_run_lock(cfg: Any) -> None:
    """Refuse (RunLocked, one line) when another process holds the lock of a cluster this invocation starts.
    Only a job's rank 0 takes the lock, so only it (or a launcher) checks; the probe creates nothing."""
    from edit_train.train.runlock import check_free, job_rank

    if job_rank() == 0:
        check_free(cfg.run.dir, job_clusters(cfg))


def _cluster_trace(path: Path, cluster: str) -> Path | None:
    """What in run.dir `path` says `cluster` ran there: its checkpoints, its records, its events."""
    own = [path / "checkpoints" / cluster, path / "clusters" / f"{cluster}.progress.json",
           path / "clusters" / f"{cluster}.json"]
    hit = next((p for p in own if p.is_file() or (p.is_dir() and any(p.iterdir()))), None)
    if hit is not None:
        return hit
    metrics = path / "metrics.jsonl"
    if metrics.is_file():  # its events (a cluster that died before its first record): a byte search, chunked
        needle = b'"cluster":' + json.dumps(cluster).encode()
        with open(metrics, "rb") as f:
            tail = b""
            while chunk := f.read(1 << 22):
                if needle in tail + chunk:
                    return metrics
                tail = chunk[-len(needle):]
    return None


def check_run_dir(run_dir: str | os.PathLike[str], resume: str, cluster: str | None = None) -> None:
    """Raise RunDirError when `run.dir` is a file (or below one), or already holds a run and `resume` is off.
    `cluster` (default: EDIT_TRAIN_CLUSTER): one cluster job; only its own traces count."""
    path = Path(run_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run.dir: {path} is a file, not a directory; choose another run.dir")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"run.dir: {parent} is a file, so {path} cannot be created there; "
                                  "choose another run.dir")
            break
    check_writable(path)
    if not path.is_dir() or str(resume).lower() in ("true", "auto") or _restarted():
        return
    cluster = cluster or os.environ.get("EDIT_TRAIN_CLUSTER")
    if cluster:  # one cluster job of a federation sharing run.dir: only this cluster's own traces count
        hit = _cluster_trace(path, cluster)
        if hit is not None:
            raise RunDirError(f"run.dir: {path} already holds cluster {cluster}'s run ({hit.relative_to(path)}); "
                              "continue it with resume=auto or choose a new run.dir")
        return
    found = _holds_run(path)
    if found is not None:
        if (path / "summary.json").is_file():
            raise RunDirError(f"run.dir: {path} already holds a finished run ({found}); "
                              f"{train_further(path)} or choose a new run.dir")
        raise RunDirError(f"run.dir: {path} already holds an unfinished run ({found}); continue it with "
                          "resume=auto (its own configuration) or choose a new run.dir")


def train_further(run_dir: str | os.PathLike[str]) -> str:
    """What trains a finished run further: `resume=auto` with a larger `train.steps` (a resume keeps the run's
    configuration, so `resume=auto` alone finds it finished; train/run_config.py)."""
    from edit_train.train.run_config import recorded

    try:
        steps = int((recorded(run_dir) or {})["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return "train it further with resume=auto and a larger train.steps"
    return f"train it further with resume=auto train.steps={2 * steps} (any count above its {steps})"


UNWRITABLE = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM)  # operator failures: exit 2


def unwritable_message(exc: OSError, run_dir: str) -> str:
    """One line for a write that failed for the operator's reasons (disk full, read-only, no permission)."""
    where = exc.filename or run_dir
    return (f"cannot write {where}: {exc.strerror or exc}; checkpoints saved before in {run_dir} are intact (each "
            "is written under a temporary name and renamed into place): free space or make it writable, then "
            "resume=auto")


def check_writable(path: Path) -> None:
    """RunDirError when `run.dir` (or, not there yet, the directory it would be made in) cannot be written: a
    read-only file system, no permission, a full disk. Tried with a file made and removed again."""
    import tempfile

    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return  # a file in the way: said by check_run_dir
    try:
        fd, probe = tempfile.mkstemp(prefix=".edit-train-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        held = " (the run in it is untouched)" if where == path and any(path.iterdir()) else ""
        raise RunDirError(f"run.dir: {where} is not writable ({exc.strerror or exc}){held}; nothing was written: "
                          "make it writable or choose another run.dir") from None


@dataclass
class RunDirGuard:
    """Remembers whether `run.dir` existed before this invocation; `cleanup()` removes it again if this
    invocation created it and nothing but launcher scaffolding (or empty folders) ended up inside."""

    path: Path
    existed: bool

    @classmethod
    def before(cls, run_dir: str | os.PathLike[str]) -> RunDirGuard:
        path = Path(run_dir).expanduser()
        return cls(path, path.exists())

    def cleanup(self) -> bool:
        if self.existed or not self.path.is_dir():
            return False
        for root, _dirs, files in os.walk(self.path):
            if any(not (Path(root) == self.path and f in SCAFFOLDING) and
                   not (Path(root) == self.path / LOCKS and f.endswith(".lock")) for f in files):
                return False
        shutil.rmtree(self.path, ignore_errors=True)
        return not self.path.exists()


def newest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint directory of `run_dir` with a manifest (written last, so it is complete)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    dirs = [p for p in root.iterdir()] + [p for d in root.iterdir() if d.is_dir() and not _STEP_DIR.match(d.name)
                                           for p in d.iterdir()]  # checkpoints/<cluster>/step_N of a federation
    steps = [(int(m.group(1)), p) for p in dirs
             if (m := _STEP_DIR.match(p.name)) and (p / "manifest.json").is_file()]
    return max(steps)[1] if steps else None


def _checkpoint_every(run_dir: str | os.PathLike[str]) -> int | None:
    """`checkpoint.every` of the run in `run_dir` (its config.json), None when unknown."""
    try:
        every = json.loads((Path(run_dir) / "config.json").read_text())["checkpoint"]["every"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return every if isinstance(every, int) and not isinstance(every, bool) else None


def interrupted_message(run_dir: str | os.PathLike[str], workers: int | None = None, detail: str = "",
                        every: int | None = None) -> str:
    """The line Ctrl-C / SIGTERM ends with: whether a checkpoint exists decides what resume=auto will do.
    `every`: the run's `checkpoint.every` (default: read from run.dir/config.json)."""
    head = "interrupted" + (f" ({detail})" if detail else "")
    if workers and workers > 1:
        head += f": all {workers} processes stopped"
    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        every = _checkpoint_every(run_dir) if every is None else every
        if every:  # it was set: the run stopped before its first one (not a setting to change)
            hint = (f"checkpoint.every={every} saves after about every {every} steps; it stopped before the first "
                    "was written")
        else:
            hint = "set checkpoint.every=N to save during the run" if every == 0 else \
                "checkpoint.every=N saves during the run"
        return f"{head} before the first checkpoint: there is nothing to resume from (resume=auto would start " \
               f"from scratch; {hint})"
    if ckpt.parent.name != "checkpoints":  # checkpoints/<cluster>/step_N: each cluster resumes its own newest
        return (f"{head}; complete checkpoints are intact, the newest {ckpt} (resume=auto continues every cluster "
                "from its own newest)")
    return f"{head}; the newest complete checkpoint {ckpt} is intact (resume=auto continues from it)"


def explicit_override(overrides: Sequence[str], key: str) -> bool:
    """Whether `key` was set on the command line (`key=…`, `+key=…`, `++key=…`)."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def adopt_tokenizer_vocab(cfg: Any, explicit: bool) -> None:
    """Raise `model.vocab_size` to the tokenizer's vocabulary when that is larger and the user did not set
    `model.vocab_size` (an explicit value is kept; the trainer then says if it is too small)."""
    if explicit:
        return
    from edit_train.data.tokenizer import load_tokenizer

    vocab = int(load_tokenizer(cfg.data.tokenizer).vocab_size)
    if vocab > cfg.model.vocab_size:
        log.info("model.vocab_size %d -> %d (the tokenizer's vocabulary)", cfg.model.vocab_size, vocab)
        cfg.model.vocab_size = vocab


def follow_tokenizer(cfg: Any) -> None:
    """`adopt_tokenizer_vocab` for the config of a Hydra job (explicit = `model.vocab_size=` on its command line)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    adopt_tokenizer_vocab(cfg, explicit_override(overrides, "model.vocab_size"))


def fail_user_error(exc: BaseException) -> NoReturn:
    """One line for a user error. Config and topology errors are the same on every rank: rank 0 says them,
    the others exit quietly with the same code. Anything else may be one rank's own: it names the rank."""
    from edit_train.cli.common import one_line
    from edit_train.config import ConfigError
    from edit_train.cluster.mesh import TopologyError

    if cut_short(exc):
        raise KeyboardInterrupt from None
    message = one_line(exc)
    if isinstance(exc, (ConfigError, TopologyError, RunDirError)):
        fail_once(message)
    rank = _torchrun_rank()
    fail(f"rank {rank}: {message}" if rank else message)


def check_data_source(source: str) -> None:
    """Fail early (before any process is spawned) when the corpus path or glob names nothing. Cheap: the
    first glob match is enough; the trainer reads the corpus (or its cached shards) itself."""
    import glob

    from edit_train.data import DataError
    from edit_train.data.corpus import is_stdlib
    from edit_train.data.families import is_family_source, parse_source

    if is_family_source(source):
        parse_source(source)  # an unknown family: one line
        return
    from edit_train.data.languages import is_language_source, parse_source as parse_language

    if is_language_source(source):
        parse_language(source)  # an unknown language: one line (a missing one: the cluster that trains on it)
        return
    if is_stdlib(source):
        return
    expanded = os.path.expanduser(source)
    if os.path.exists(expanded):
        return
    if glob.has_magic(expanded):
        if next(glob.iglob(expanded, recursive=True), None) is None:
            raise DataError(f"corpus glob {source!r} matched no files; check the pattern (quote it so the shell "
                            "does not expand it)")
        return
    raise DataError(f"corpus path {source} does not exist; pass a file, directory, glob or 'stdlib'")


def check_data(cfg: Any) -> None:
    """Every corpus this invocation trains on names something, and every cluster it starts tokenizes as
    data.tokenizer does (a local run: all of them, before any starts; a cluster job: its own)."""
    from edit_train.config import cluster_specs
    from edit_train.train.site_data import check_tokenizers

    mine = job_cluster(cfg)
    specs = [s for s in cluster_specs(cfg) if mine is None or s.name == mine]
    for source in dict.fromkeys([cfg.data.source] + [s.source for s in specs if s.source]):
        check_data_source(source)
    check_tokenizers(cfg, specs)


def check_init_from(init_from: str | None) -> None:
    """Fail early when `model.init_from` names nothing on disk (a Hub name: the offline line)."""
    if not init_from or os.path.isdir(os.path.expanduser(init_from)):
        return
    from edit_train.config import ConfigError
    from edit_train.offline import looks_like_hub_name, offline_hint

    if looks_like_hub_name(init_from):
        raise ConfigError(offline_hint(init_from, "model.init_from"))
    raise ConfigError(f"model.init_from={init_from}: not a directory; give a Hugging Face BailingMoe directory "
                      f"(config.json + safetensors), e.g. one written by edit-train-export")


def nothing_left(cfg: Any, specs: list[Any], cluster: str | None) -> None:
    """Exit 0 with one line when there is nothing left to do: the run finished, or (a cluster job, `cluster`)
    its federation finished without it (train/finished.py)."""
    from edit_train.train.finished import finished_line, run_finished_line

    configured = [s.name for s in specs]
    if cluster is None:
        line = run_finished_line(cfg.run.dir, configured, cfg.train.steps)
    else:
        federated = len(specs) > 1 or bool(cfg.federation.lighthouse)
        from edit_train.train.progress import restart_count

        line = finished_line(cfg.run.dir, cluster, configured, cfg.train.steps, federated, restart_count() > 0)
        if line is None and federated and restart_count() == 0:
            line = _finished_by_gate(cfg, cluster, configured)
    if line is not None:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(0)


def _finished_by_gate(cfg: Any, cluster: str, configured: list[str]) -> str | None:
    """Across sites (a run.dir per cluster): a cluster resumed over its own run (its progress record) asks the
    gate which roster members finished; the line when a strict majority of the configured clusters did
    (train/finished.py; a minority's notices are said in one line and not counted)."""
    from edit_train.train.progress import record_path

    f = cfg.federation
    if not f.lighthouse or not f.roster_file or not record_path(Path(cfg.run.dir).expanduser(), cluster).is_file():
        return None
    from edit_train.federation import auth
    from edit_train.federation.quorum import finished_peers
    from edit_train.train.build import credentials
    from edit_train.train.finished import gate_finished_line

    try:
        key = auth.resolve(f.key_file, f.insecure, [f.lighthouse])
        creds = credentials(cfg, cluster)
    except Exception:  # noqa: BLE001 - a bad key or identity is said by the run's own checks, in one line
        return None
    done = finished_peers(f.lighthouse, cluster, key, creds)
    keys = {n: creds.key_id(n) for n in done} if creds is not None else {}
    line, minority = gate_finished_line(cluster, configured, cfg.train.steps, done, f.lighthouse, keys)
    if minority is not None and int(os.environ.get("RANK", "0") or 0) == 0:
        print(minority, file=sys.stderr, flush=True)
    return line


def relaunched(cfg: Any) -> str | None:
    """A cluster job started again over its own run (`clusters/<name>.progress.json` in run.dir, or only its traces:
    a job stopped during start-up leaves its events in metrics.jsonl and no record) without `resume`: it continues
    that run, as `resume=auto` would; returns the line that says so (None: nothing to continue, or `resume` already
    set). A whole run is still refused over an earlier one (check_run_dir)."""
    from edit_train.train.progress import record_path

    name = job_cluster(cfg)
    if name is None or str(cfg.resume).lower() in ("true", "auto") or _restarted():
        return None
    path = Path(cfg.run.dir).expanduser()
    record = record_path(path, name)
    if record.is_file():
        return f"cluster {name}: run.dir {cfg.run.dir} holds its earlier run ({record.name}): resuming it (resume=auto)"
    # stopped before its first record (during start-up, or before its first sync): its events, nothing to resume
    # from. (Its checkpoints without a record are no run this job can tell is its own: check_run_dir refuses them.)
    trace = _cluster_trace(path, name) if path.is_dir() else None
    if trace is None or trace.name != "metrics.jsonl":
        return None
    return (f"cluster {name}: run.dir {cfg.run.dir} holds only its earlier start (its events in metrics.jsonl, no "
            "record, no checkpoint): starting it again (resume=auto)")


def precheck(argv: list[str]) -> tuple[RunDirGuard | None, list[str]]:
    """Compose and validate the config of a single run and check its `run.dir` before Hydra creates it, so
    a user mistake fails in one line and leaves nothing behind. Returns the guard of `run.dir` and overrides
    to add: `run.dir=<the directory checked>` when it was not given (the default holds `${now:}`), and
    `resume=auto` for a cluster job relaunched over its own run (`relaunched`)."""
    from edit_train.cli.common import compose, one_line
    from edit_train.config import validate

    if any(a in ("-m", "--multirun") or a.startswith("-") for a in argv):
        return None, []
    added: list[str] = []
    try:
        cfg = compose(argv)
        validate(cfg)
        check_run_lock(cfg)  # another process writing one of our clusters: say who, before anything else
        line = None if explicit_override(argv, "resume") else relaunched(cfg)
        if line is not None:
            if not _torchrun_rank():
                print(line, file=sys.stderr, flush=True)
            cfg.resume = "auto"
            added.append("resume=auto")
        check_run_dir(cfg.run.dir, cfg.resume, job_cluster(cfg))
        cfg = own_config(argv, cfg)
        check_data(cfg)
        check_init_from(cfg.model.init_from)
        if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun worker: check its cluster's
            from edit_train.cluster.mesh import check_shape       # size before Hydra creates run.dir
            from edit_train.config import cluster_specs
            from edit_train.train.build import my_cluster

            from edit_train.train.site_data import site_data

            specs = cluster_specs(cfg)
            spec = my_cluster(cfg, specs)  # a cluster added mid-run: its index (or one line why it has none)
            check_shape(int(os.environ["WORLD_SIZE"]), spec.ranks, spec.name)
            site_data(cfg, specs, spec)  # ... and its data part
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        if cut_short(exc):
            raise KeyboardInterrupt from None
        fail_once(one_line(exc))
    pin = None if explicit_override(argv, "run.dir") else _pin(cfg.run.dir)
    return RunDirGuard.before(cfg.run.dir), added + ([pin] if pin else [])


# the configuration a resume continues (`own_config`, set by `precheck`): `_task` trains with it, not with the
# command line's composition (None: not a resume of a run with a recorded configuration)
RESUMED: list[dict[str, Any]] = []


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def own_config(argv: Sequence[str], cfg: Any) -> Any:
    """A resume (`resume=auto`, a relaunched cluster job, a torchrun restart) of a run whose run.dir records its
    configuration (config.json + resumes.jsonl, train/run_config.py) continues with that configuration: a key
    the command line does not set keeps the run's value; a key it sets to another value is refused in one line
    (`ResumeRefused`) unless a resume may change it (`run_config.RESUMABLE`: said in one line, recorded in
    resumes.jsonl by the trainer). Returns the config to train with (`cfg` itself when there is no record, and for
    the job of a cluster other than the first: config.json records the first cluster's job)."""
    from edit_train.cli.common import compose, one_line
    from edit_train.config import from_container, to_container
    from edit_train.train import run_config as rc

    RESUMED.clear()
    if str(cfg.resume).lower() not in ("true", "auto") and not _restarted():
        return cfg
    from edit_train.config import cluster_specs

    mine = job_cluster(cfg)
    if mine is not None and mine != cluster_specs(cfg)[0].name:
        return cfg  # config.json is the first cluster's (its job writes it): another cluster's job has no record
    record = rc.recorded(cfg.run.dir)
    if record is None:
        return cfg

    def may_change(key: str) -> bool:  # a group choice (`logger=none`) of a resumable section counts as one
        return rc.resumable(key) or rc.resumable(key + ".")

    identity = [o for o in argv if _key(o) in rc.IDENTITY]
    kept = [o for o in argv if may_change(_key(o))]
    given = to_container(cfg)
    full, kept_cfg = rc.flat(given), rc.flat(to_container(compose(kept)))
    base = rc.flat(to_container(compose(identity)))
    by_command_line = {k for k in full if full[k] != kept_cfg.get(k)}
    resumable_given = {k for k in kept_cfg if rc.resumable(k) and kept_cfg[k] != base.get(k)} | \
        {_key(o) for o in kept if _key(o) in full}  # set explicitly, even to the default
    adopted, changes = rc.resolve(record, given, by_command_line, resumable_given)
    if changes and not _torchrun_rank():
        said = ", ".join(f"{k} {pair[0]!r} -> {pair[1]!r}" for k, pair in changes.items())
        print(f"resume: {said} (a resume may change these; recorded in {Path(cfg.run.dir) / rc.RESUMES}, "
              f"{rc.CONFIG} is kept)", file=sys.stderr, flush=True)
    try:
        out = from_container(adopted)
    except Exception as exc:  # noqa: BLE001 - a record of another version: one line
        raise RunDirError(f"run.dir {cfg.run.dir}: its {rc.CONFIG} does not fit this version's configuration "
                          f"({one_line(exc)}); choose a new run.dir") from None
    RESUMED.append(adopted)
    return out


def _pin(run_dir: str) -> str | None:
    """`run.dir=<the directory checked>` as a Hydra override (quoted when needed), or None if it cannot be."""
    if re.fullmatch(r"[A-Za-z0-9_./-]+", run_dir):
        return f"run.dir={run_dir}"
    if "'" in run_dir or "\\" in run_dir or "$" in run_dir:
        return None
    return f"run.dir='{run_dir}'"
