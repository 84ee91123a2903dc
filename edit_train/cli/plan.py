"""`edit-train plan` / `edit-train-plan`: predict, before launching, what each algorithm × sync mode ×
compression × interval gives on a described federation; `... plan calibrate RUN_DIR...` fits the costs the
prediction runs on from finished runs.

    edit-train plan                                   # conf/plan/default.yaml + scenario=three_clusters
    edit-train plan scenario=local_2x1 profile=runs/profile.json out=runs/plan
    edit-train plan scenario.link.bandwidth_mbps=1000 'scenario.candidates.algos=[edit,a_edit]'
    edit-train plan calibrate runs/a runs/b --out runs/profile.json  # --no-codec: leave the codec untimed (cost 0)
    edit-train plan check runs/profile.json          # one line: do its calibration conditions hold now?

The config is Hydra's (its own tree, `conf/plan/`): overrides are `key=value`; every input mistake ends in
one `error: ...` line and exit code 2. `check` exits 0 when the profile's conditions (load, cores, speed)
hold on this host now, 1 when its predictions no longer apply.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edit_train.cli.common import CONF_DIR, fail, one_line

PLAN_CONF = str(Path(CONF_DIR) / "plan")
USAGE = __doc__ or ""


def compose_plan(overrides: list[str]) -> dict[str, Any]:
    """conf/plan/default.yaml with `overrides`, as a plain dict."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=PLAN_CONF, version_base=None):
        cfg = compose(config_name="default", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def run_plan(overrides: list[str]) -> dict[str, Any]:
    """Compose, simulate, print the table and the recommendation, write plan.json + plan.png; returns the JSON."""
    from edit_train.plan import report
    from edit_train.plan.planner import make_plan
    from edit_train.plan.profile import Profile
    from edit_train.plan.spec import scenario_from_dict

    cfg = compose_plan(overrides)
    scn = scenario_from_dict(dict(cfg["scenario"]))
    profile = Profile.load(cfg["profile"]) if cfg.get("profile") else None
    stale = condition_line(profile)[1] if profile is not None else None
    plan = make_plan(scn, profile, seed=int(cfg["seed"]), quick=bool(cfg["quick"]))
    if stale:
        plan.notes.insert(0, stale)
    out = Path(str(cfg["out"]))
    js = report.write_json(plan, out / "plan.json")
    png = report.plot(plan, out / "plan.png")
    print(f"plan {scn.name}: {scn.accelerators} accelerators in {len(scn.clusters)} clusters, "
          f"{len(plan.rows)} candidates, {plan.events:,} events in {plan.elapsed_s:.1f} s "
          f"({plan.events_per_s:,.0f} events/s)")
    print(report.table(plan, top=int(cfg["top"])))
    print(report.recommendation(plan))  # a stale calibration is its first note
    if plan.subsets:
        print(report.subsets_block(plan))
    print(f"wrote {js} and {png}")
    return report.to_json(plan)


def condition_line(profile) -> tuple[str, str | None]:  # noqa: ANN001 - plan.profile.Profile
    """(the one line about `profile`'s calibration conditions now, the same line when they no longer hold)."""
    from edit_train.plan import conditions

    then = profile.taken_under()
    if then is None:
        return "the profile records no calibration conditions (calibrated before they were recorded)", None
    now = conditions.measure()
    why = conditions.stale(then, now)
    return (why, why) if why else (conditions.holds(then, now), None)


def run_check(args: list[str]) -> int:
    """`plan check [PROFILE | profile=PROFILE]`: print one line; 0 when the conditions hold, 1 when not."""
    from edit_train.plan.profile import Profile

    paths = [a.split("=", 1)[1] if a.startswith("profile=") else a for a in args]
    if len(paths) != 1 or not paths[0]:
        raise ValueError("check: give one profile (usage: edit-train plan check PROFILE)")
    line, stale = condition_line(Profile.load(paths[0]))
    print(f"{paths[0]}: {line}")
    return 1 if stale else 0


def progress_lines(what: str) -> Callable[[str], None]:
    """A function that writes `what [12s] text` lines to stderr (seconds since it was made)."""
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"{what} [{time.monotonic() - t0:.0f}s] {text}", file=sys.stderr, flush=True)

    return say


def run_calibrate(args: list[str]) -> Path:
    from edit_train.cli.codec_cost import compile_seconds, time_codecs
    from edit_train.plan.calibrate import calibrate, codec_of_run, read_run
    from edit_train.plan.spec import CandidateSet, Scenario, TopK, topk_codec

    out, dirs, i, time_codec = Path("profile.json"), [], 0, True
    while i < len(args):
        a = args[i]
        if a in ("--out", "-o"):
            if i + 1 >= len(args):
                raise ValueError("calibrate: --out needs a file name")
            out, i = Path(args[i + 1]), i + 2
            continue
        if a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
        elif a == "--no-codec":
            time_codec = False
        elif a.startswith("-"):
            raise ValueError(f"calibrate: unknown option {a!r} (usage: calibrate RUN_DIR... [--out FILE] [--no-codec])")
        else:
            dirs.append(a)
        i += 1
    if not dirs:
        raise ValueError("calibrate: give at least one run directory")
    # the codec of every compression the planner may propose (and the runs' own), timed on this host
    runs = [read_run(d).config for d in dirs]
    codecs = [codec_of_run(c) for c in runs]
    codecs += [codec_of_run({"sync": {**(runs[0].get("sync") or {}), "compression": c}}) for c in ("bf16", "int8", "fp8")]
    base = Scenario("codecs", [], block_size=codecs[0].block_size, scale_dtype=codecs[0].scale_dtype)
    codecs += [topk_codec(base, TopK(**t)) for t in CandidateSet().topk]
    sparse = next((c for c in codecs if c.sparse), None)
    say = progress_lines("calibrate")  # the codec's timing takes ~a minute: say what is being timed
    prof = calibrate(dirs, codec=time_codecs(codecs, say) if time_codec else None,
                     compile_s=compile_seconds(sparse, say=say) if time_codec and sparse is not None else 0.0)
    path = prof.save(out)
    fit = prof.fit
    sync = fit.get("sync", {})
    print(f"calibrated from {len(dirs)} run(s): one rank's step median {prof.rank_step.median_s * 1e3:.1f} ms "
          f"(log-σ {prof.rank_step.sigma:.2f}); sync per op {prof.per_op_s * 1e3:.2f} ms, per byte "
          f"{'link only' if not prof.sw_bytes_per_s else f'{prof.sw_bytes_per_s / 1e6:.0f} MB/s'} over "
          f"{len(sync.get('message_sizes', []))} message size(s), {sync.get('samples', 0)} syncs"
          f"{'' if 'note' not in sync else ' — ' + sync['note']}; eval {prof.eval_s:.2f} s, "
          f"checkpoint {prof.checkpoint_s:.2f} s, start-up {prof.startup_s:.1f} s; codec timed for "
          f"{', '.join(prof.codec) or 'none'}"
          f"{f' (a new top-k format compiles in {prof.codec_compile_s:.0f} CPU-s)' if prof.codec_compile_s else ''}")
    then = prof.taken_under()
    if then is not None:
        print(f"conditions: {then.describe()}, probe speed {then.speed:,.0f}/s (`edit-train plan check {path}` "
              "compares them with the host's later)")
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    from edit_train.plan.calibrate import CalibrationError
    from edit_train.plan.spec import PlanError

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in args[:1]):
        print(USAGE)
        return
    try:
        if args[:1] == ["calibrate"]:
            run_calibrate(args[1:])
        elif args[:1] == ["check"]:
            sys.exit(run_check(args[1:]))
        else:
            bad = [a for a in args if "=" not in a]
            if bad:
                raise ValueError(f"plan: {bad[0]!r} is not an override (key=value) nor `calibrate` / `check`; see "
                                 "`edit-train plan --help`")
            run_plan(args)
    except (PlanError, CalibrationError, ValueError, OSError) as exc:
        fail(one_line(exc))
    except Exception as exc:  # Hydra / OmegaConf composition errors
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(exc, (HydraException, OmegaConfBaseException)):
            fail(one_line(exc))
        raise


if __name__ == "__main__":
    main()
