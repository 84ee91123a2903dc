"""Which data each cluster trains on, and the validation every cluster evaluates on (per-site data).

The federation's `data` is what every cluster validates on and what a cluster without data of its own trains
on; clusters that train on the same source split it (the default: one corpus split across all clusters). A
cluster may name its own source (`cluster.clusters[i].data.source`, a site's own corpus), and `data.split=
by_family` gives cluster i of N its standard-library families (`data/families.py`) and validates every
cluster on all of them, window by window. Every corpus must be tokenized alike: a cluster's own tokenizer
must have the content of `data.tokenizer` (`check_tokenizers`; across hosts the config fingerprint carries it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edit_train.config import ClusterSpec, Config, ConfigError
from edit_train.data import languages
from edit_train.data.families import NAMES, group_sources, source_of
from edit_train.data.prepare import ensure_dataset
from edit_train.data.tokenizer import DataError
from edit_train.data.tokenizer import tokenizer_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SiteData:
    source: str  # the corpus this cluster trains on
    tokenizer: str  # its tokenizer (same content as data.tokenizer)
    part: int  # this cluster's part of `source` ...
    parts: int  # ... which this many clusters split
    val_sources: tuple[str, ...]  # the shared validation: these sources' val splits, window by window


def train_source(cfg: Config, spec: ClusterSpec, clusters: int) -> str:
    """The corpus `spec`'s cluster trains on, in a federation of `clusters` configured clusters."""
    if spec.source:
        return spec.source
    if cfg.data.split == "by_family":
        return group_sources(clusters)[spec.index % clusters]
    if cfg.data.split == "by_language":
        return languages.group_sources(clusters)[spec.index % clusters]
    return cfg.data.source


def val_sources(cfg: Config) -> tuple[str, ...]:
    """What every cluster validates on: every family under data.split=by_family; every language (this machine
    holds) under by_language or data.source=lang:all; else data.source."""
    if cfg.data.split == "by_family":
        return tuple(source_of((f,)) for f in NAMES)
    if cfg.data.split == "by_language" or cfg.data.source == "lang:all":
        return languages.present(tuple(languages.source_of(n) for n in languages.NAMES))
    return (cfg.data.source,)


def site_data(cfg: Config, specs: list[ClusterSpec], spec: ClusterSpec) -> SiteData:
    """This cluster's data: its source, and its part of it among the clusters that train on the same one
    (`data.parts` of it, at least one per configured cluster). A cluster added mid-run (not configured, its index
    after theirs: train/build.py `joiner_index`) takes the first part kept for such clusters — or is refused in
    one line when the plan kept none for it."""
    mine = train_source(cfg, spec, len(specs))
    sharing = [s.name for s in specs if train_source(cfg, s, len(specs)) == mine]
    parts = max(cfg.data.parts, len(sharing), 1)
    if spec.name in sharing:
        part = sharing.index(spec.name)
    else:
        part = len(sharing) + spec.index - len(specs)  # the joiners come in order after the configured clusters
        if cfg.data.split in ("by_family", "by_language"):
            what = "family" if cfg.data.split == "by_family" else "language"
            raise ConfigError(f"cluster {spec.name} joins the federation, but data.split={cfg.data.split} gives every "
                              f"{what} to the {len(specs)} configured clusters and none to it: list it in "
                              "cluster.clusters")
        if part >= parts:
            kept = f" and keeps {parts - len(sharing)} for clusters added later" if parts > len(sharing) else ""
            raise ConfigError(f"cluster {spec.name} joins the federation, but the data plan has no part of {mine} for "
                              f"it: data.parts={cfg.data.parts} cuts it into one part per configured cluster{kept}; "
                              f"start the federation with data.parts={part + 1} (or more) to keep a part for every "
                              "cluster added mid-run, or list it in cluster.clusters")
    if languages.is_language_source(mine):
        try:
            languages.check_language(mine, f"cluster {spec.name}")
        except DataError as exc:
            raise ConfigError(str(exc)) from None
    return SiteData(mine, spec.tokenizer or cfg.data.tokenizer, part, parts, val_sources(cfg))


def check_tokenizers(cfg: Config, specs: list[ClusterSpec]) -> None:
    """Every cluster's own tokenizer has the content of data.tokenizer (the shared validation's): else one line
    naming both. A local run checks every cluster before starting any; a cluster job checks its own."""
    federation = tokenizer_id(cfg.data.tokenizer)
    for s in specs:
        if s.tokenizer and (own := tokenizer_id(s.tokenizer)) != federation:
            raise ConfigError(f"cluster.clusters[{s.index}].data.tokenizer: cluster {s.name} tokenizes with {own} "
                              f"({s.tokenizer}), the federation with {federation} (data.tokenizer="
                              f"{cfg.data.tokenizer}); every cluster must use the federation's tokenizer")


def open_data(cfg: Config, site: SiteData, cluster_batch: int, is_leader: bool,
              barrier: Callable[[], None]) -> tuple[Path, list[Path]]:
    """(this cluster's training dataset, the shared validation datasets), prepared once by the cluster's rank 0
    (the others wait, then read the cache). Says when the run will see its corpus more than once."""
    d, t = cfg.data, cfg.train

    def prepare() -> tuple[Path, list[Path]]:
        how = {"val_fraction": d.val_fraction, "seed": d.seed, "text_column": d.text_column,
               "token_dtype": d.token_dtype, "workers": d.workers}  # every source is read alike
        train = ensure_dataset(site.source, site.tokenizer, d.cache_dir,
                               min_tokens=site.parts * cluster_batch * (t.seq_len + 1), **how)
        vals = [ensure_dataset(src, d.tokenizer, d.cache_dir, **how) for src in site.val_sources]
        return train, vals

    out = prepare() if is_leader else None
    barrier()
    train, vals = out or prepare()
    meta = json.loads((train / "meta.json").read_text())
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({meta['vocab_size']}); raise model.vocab_size")
    have = int(meta["splits"]["train"]["tokens"]) // site.parts
    need = t.steps * cluster_batch * t.seq_len * t.grad_accum
    if is_leader and have < need and site.source != d.source:  # a site's own corpus (or family) runs short
        log.warning("data %s: this cluster's part holds %s training tokens, %d steps read %s: it sees its data "
                    "%.1f times", site.source, f"{have:,}", t.steps, f"{need:,}", need / max(have, 1))
    return train, vals
