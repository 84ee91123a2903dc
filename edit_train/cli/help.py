"""`edit-train --help`: what the program does, its config groups (options read from the shipped config tree,
so the page cannot drift from it), the most used keys and where the full reference is."""

from __future__ import annotations

from pathlib import Path

from edit_train.cli.common import CONF_DIR

# One line per config group, in the order a newcomer meets them.
GROUPS: dict[str, str] = {
    "model": "the MoE architecture (Ling / BailingMoe style)",
    "data": "the corpus: stdlib (this interpreter's library source) or text (your files, data.source=...)",
    "algo": "how the clusters combine their work: ddp, local SGD variants, EDiT, A-EDiT",
    "cluster": "the clusters (each its own job: ranks, speed, device) and the simulated link between them",
    "logger": "Weights & Biases (offline unless you have a key) or none",
    "experiment": "benchmark presets that set several groups and keys at once (optional)",
    "plan": "not a training group: `edit-train plan [scenario=...]` reads conf/plan/ (README \"Plan a launch\")",
}

# The five keys people set most, with what they do.
KEYS: tuple[tuple[str, str], ...] = (
    ("run.dir=PATH", "where everything of the run goes (default runs/<timestamp>)"),
    ("train.steps=N", "inner steps per cluster"),
    ("data.source=GLOB", "your corpus with data=text: text files, a directory or .jsonl"),
    ("resume=auto", "continue from the newest complete checkpoint in run.dir"),
    ("train.batch_size=B", "sequences per rank per micro-batch (train.seq_len: tokens per sequence)"),
)


def options(group: str, conf_dir: str | Path = CONF_DIR) -> list[str]:
    """The choices of a config group: the YAML files of its folder."""
    return sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))


def defaults(conf_dir: str | Path = CONF_DIR) -> dict[str, str]:
    """group -> the option `conf/config.yaml` picks."""
    from omegaconf import OmegaConf

    out: dict[str, str] = {}
    for entry in OmegaConf.load(Path(conf_dir) / "config.yaml").get("defaults", []):
        if isinstance(entry, str) or not hasattr(entry, "items"):
            continue
        for key, value in entry.items():
            group = str(key).removeprefix("optional ").strip()
            if group in GROUPS and value is not None:
                out[group] = str(value)
    return out


def help_text(conf_dir: str | Path = CONF_DIR) -> str:
    chosen = defaults(conf_dir)
    width = max(len(g) for g in GROUPS) + 2
    lines = [
        "edit-train: train one Mixture-of-Experts language model on several clusters at once with EDiT local SGD.",
        "Every cluster (its own job) trains its own replica; the replicas are merged every so often by an",
        "anomaly-aware aggregator, layer by layer inside the next forward pass. A-EDiT (algo=a_edit) makes the",
        "sync interval a wall-clock budget, so a fast cluster takes more steps than a slow one and nobody waits.",
        "",
        "usage: edit-train [GROUP=OPTION ...] [KEY=VALUE ...]    one run",
        "       edit-train -m KEY=A,B [...]                       a sweep: one run per combination",
        "       edit-train --cfg job [overrides]                  print the resolved config, run nothing",
        "",
        "with no arguments: two clusters of different speed (1x, 3x) over a simulated slow link, A-EDiT;",
        "edit-train experiment=single is one process. Each cluster is its own job; see README \"Run across sites\".",
        "",
        "config groups (GROUP=OPTION; * = default):",
    ]
    for group, what in GROUPS.items():
        opts = [f"{o}*" if chosen.get(group) == o else o for o in options(group, conf_dir)]
        lines.append(f"  {group + '=':<{width}}{what}")
        lines.append(f"  {'':<{width}}  {', '.join(opts)}")
    lines += ["", "most used keys:"]
    kw = max(len(k) for k, _ in KEYS) + 2
    lines += [f"  {key:<{kw}}{what}" for key, what in KEYS]
    lines += [
        "",
        "full reference: `edit-train --cfg job` prints every key with its value; docs/configuration.md",
        "explains each one; the typed configs are edit_train/config.py; the design is docs/architecture.md.",
        "related commands: edit-train-prepare (corpus), edit-train-info (sizing), edit-train-report (plots),",
        "edit-train-export (Hugging Face directory). Hydra's own options: edit-train --hydra-help.",
    ]
    return "\n".join(lines)


def wants_help(argv: list[str]) -> bool:
    return any(a in ("--help", "-h") for a in argv)
