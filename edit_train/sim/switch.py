"""Simulation only when asked: which settings simulate, and whether this process may apply them.

The simulated settings (`cluster.slowdown`, a cluster's `slowdown` in `cluster.clusters`,
`cluster.slowdown_schedule`, `cluster.link.*`, `faults`) stand in for slow hardware, a WAN and failures on ONE
host. A local run (`edit-train` starts the Lighthouse and every cluster itself) applies them. A cluster job of a
real federation (under torchrun/Slurm, or given `federation.lighthouse`, `cluster.only` or `federation.host`)
runs on the real network: when it names no `cluster=` preset it gets `cluster=real` (no simulation) instead of
the demo's default, and a simulated setting it names is refused in one line unless `sim.force=true` says the
simulation is meant (tests that run real cluster jobs on one host)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# the preset a cluster job of a real federation starts from when it names none (conf/cluster/real.yaml)
REAL_PRESET = "real"
_JOB_KEYS = ("federation.lighthouse", "cluster.only", "federation.host")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~") if "=" in override and not override.startswith("-") else ""


def _torchrun(env: Mapping[str, str]) -> bool:
    """Under torchrun (or its environment), but not a rank of the local launcher (which marks its ranks)."""
    started = "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)
    return started and not env.get("EDIT_TRAIN_LAUNCHER_BAR")


def real_job_overrides(overrides: list[str], env: Mapping[str, str] | None = None) -> str:
    """Why the command line `overrides` (in `env`) start a cluster job of a real federation, '' if they do not
    (a local run, or not decidable before composing: `real_job` says it after)."""
    env = os.environ if env is None else env
    if _torchrun(env):
        return "it runs under torchrun"
    given = [k for k in map(_key, overrides) if k in _JOB_KEYS]
    return f"{given[0]} is given" if given else ""


def real_preset(overrides: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """`["cluster=real"]` for a cluster job of a real federation that names no `cluster=` preset (nor an
    `experiment=`, which may pick one): the demo's default (`hetero_2x1`, a simulated WAN and a 3x slower
    second cluster) must not ride along into a real job. Appended to the user's overrides, like
    `cli/common.equal_clusters`."""
    keys = {_key(o) for o in overrides}
    if keys & {"cluster", "experiment"} or not real_job_overrides(overrides, env):
        return []
    return [f"cluster={REAL_PRESET}"]


def real_job(cfg: Any, env: Mapping[str, str] | None = None) -> str:
    """Why the composed `cfg` (in `env`) is a cluster job of a real federation, '' for a local run."""
    env = os.environ if env is None else env
    if _torchrun(env):
        return "it runs under torchrun"
    f = cfg.federation
    if f.lighthouse:
        return f"federation.lighthouse={f.lighthouse} is given"
    if cfg.cluster.only:
        return f"cluster.only={cfg.cluster.only} is given"
    if f.host not in ("127.0.0.1", "localhost", "::1"):
        return f"federation.host={f.host} is given"
    return ""


def simulated(cfg: Any) -> list[str]:
    """The simulated settings in effect in `cfg`, as the overrides that would name them ([] = none)."""
    c = cfg.cluster
    out = []
    if c.link.bandwidth_mbps or c.link.latency_ms:
        out.append(f"cluster.link.bandwidth_mbps={c.link.bandwidth_mbps:g} "
                   f"cluster.link.latency_ms={c.link.latency_ms:g}")
    if any(float(s) != 1.0 for s in c.slowdown):
        out.append(f"cluster.slowdown=[{','.join(f'{float(s):g}' for s in c.slowdown)}]")
    slow = [f"{spec.get('name', i)}:{float(spec['slowdown']):g}" for i, spec in enumerate(c.clusters)
            if isinstance(spec, Mapping) and float(spec.get("slowdown", 1.0) or 1.0) != 1.0]
    if slow:
        out.append(f"a slowdown in cluster.clusters ({', '.join(slow)})")
    if c.slowdown_schedule:
        out.append("cluster.slowdown_schedule")
    if cfg.faults:
        out.append("faults")
    return out


def check_real_network(cfg: Any, env: Mapping[str, str] | None = None) -> None:
    """Refuse (ConfigError, one line) a simulated setting in a cluster job of a real federation, unless
    `sim.force=true`: its transfers would wait for a fake link and its steps sleep for a fake slowdown."""
    from edit_train.fields import ConfigError

    why = real_job(cfg, env)
    named = simulated(cfg) if why else []
    if named and not cfg.sim.force:
        raise ConfigError(
            f"{'; '.join(named)}: simulated (slow hardware, a WAN, failures on one host), but this is a cluster "
            f"job of a real federation ({why}): it runs on the real network. Drop it (start from cluster={REAL_PRESET}"
            f"{'' if cfg.cluster.name == REAL_PRESET else f', not cluster={cfg.cluster.name}'}), or pass "
            "sim.force=true to simulate on purpose")
