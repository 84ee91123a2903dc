"""Four languages every machine holds, offline: a non-IID setting where the sites really differ.

A data source ``lang:<language>`` is a deterministic, size-capped sample of one language's files on this machine;
``lang:all`` is the four together (the IID counterpart: one corpus holding every language, split across the
clusters). The languages and where they live:

=========  ====================  ===================================================================
language   root                  files
=========  ====================  ===================================================================
python     the standard library  ``*.py`` (tests, idlelib, lib2to3, site-packages left out)
c          ``/usr/include``      C and C++ headers: ``*.h``, ``*.hpp``, ``*.hh``, ``*.hxx``, ``*.tcc`` and the
                                 suffix-less standard headers under ``c++/``
perl       ``/usr/share/perl``   ``*.pm``, ``*.pl``, ``*.pod``
man        ``/usr/share/man``    the English manual pages (``man1`` … ``man8``, gzipped troff, read unzipped)
=========  ====================  ===================================================================

``EDIT_TRAIN_LANG_ROOTS=c=/x,perl=/y`` moves a language's root (tests point one at a fake or missing directory).

**Balanced and capped.** Each language keeps its files in the order of a hash of their key until they hold
`BUDGET` bytes on disk (the man pages' are gzipped: `BUDGET_GZ` of them, about as much text), so every language
weighs about the same whatever the machine installed and preparing stays quick. A document's *key* is its
absolute path without the leading ``/``, the same in ``lang:c`` and in ``lang:all``, and each language is split
into train/val on its own by size (`corpus.planned_sides`), so ``lang:all``'s validation is exactly the four
languages' together: no cluster trains on a window the shared validation holds.

**A missing language** (its root absent, or holding none of its files): a cluster that trains on it is refused in
one line (`check_language`); the shared validation skips it with one warning line (`present`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from .tokenizer import DataError

log = logging.getLogger(__name__)

PREFIX = "lang:"
NAMES = ("python", "c", "perl", "man")
# data.split=by_language: the language each cluster trains on, by the number of clusters. Two clusters: the
# standard library's Python (the repo's default corpus) and the English manual pages — code against prose, the
# pair farthest apart, so the routing skew has the most room.
GROUPS: dict[int, tuple[str, ...]] = {2: ("python", "man"), 3: ("python", "c", "man"), 4: NAMES}
BUDGET = 6 << 20  # bytes on disk per language
BUDGET_GZ = 2 << 20  # ... of gzipped manual pages (troff compresses about 3:1)
_SUFFIXES = {"c": (".h", ".hpp", ".hh", ".hxx", ".tcc"), "perl": (".pm", ".pl", ".pod"), "man": (".gz",)}
_SKIP_PY = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_INSTALL = {"python": "the interpreter's standard library", "c": "libc6-dev / linux-libc-dev / libstdc++-dev",
            "perl": "perl-modules", "man": "man pages (manpages, unminimize)"}


def is_language_source(source: str | None) -> bool:
    return source is not None and source.startswith(PREFIX)


def parse_source(source: str) -> tuple[str, ...]:
    """The languages of ``lang:<language>`` (``lang:all``: every one)."""
    spec = source[len(PREFIX):]
    if spec == "all":
        return NAMES
    if spec not in NAMES:
        raise DataError(f"data source {source!r}: unknown language {spec!r}; use lang:<language> with languages "
                        f"{', '.join(NAMES)}, or lang:all")
    return (spec,)


def source_of(language: str) -> str:
    return PREFIX + language


def group_sources(clusters: int) -> list[str]:
    """The training source of each cluster of a ``data.split=by_language`` run of `clusters` clusters."""
    if clusters not in GROUPS:
        raise DataError(f"data.split=by_language: defined for {', '.join(map(str, GROUPS))} clusters, this run has "
                        f"{clusters}; name each cluster's data in cluster.clusters[i].data.source=lang:<language> "
                        f"(languages {', '.join(NAMES)}) instead")
    return [source_of(n) for n in GROUPS[clusters]]


def roots() -> dict[str, Path]:
    """Each language's root directory (``EDIT_TRAIN_LANG_ROOTS`` overrides some)."""
    import sysconfig

    out = {"python": Path(sysconfig.get_paths()["stdlib"]), "c": Path("/usr/include"),
           "perl": Path("/usr/share/perl"), "man": Path("/usr/share/man")}
    for item in filter(None, os.environ.get("EDIT_TRAIN_LANG_ROOTS", "").split(",")):
        name, _, path = item.partition("=")
        if name not in out or not path:
            raise DataError(f"EDIT_TRAIN_LANG_ROOTS: {item!r} is not <language>=<directory> with languages "
                            f"{', '.join(NAMES)}")
        out[name] = Path(path).absolute()
    return out


def _wanted(language: str, rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if language == "python":
        return name.endswith(".py")
    if language == "c":
        return name.endswith(_SUFFIXES["c"]) or ("c++/" in rel and "." not in name)
    if language == "man":  # the English pages: manN/... (the translations live in <lang>/manN)
        return name.endswith(".gz") and rel.startswith("man") and "/" in rel
    return name.endswith(_SUFFIXES[language])


def key_of(path: Path) -> str:
    """A document's key: its absolute path without the leading ``/`` (the same in every source holding it)."""
    return Path(os.path.abspath(path)).as_posix().lstrip("/")


def _score(key: str) -> bytes:
    return hashlib.sha1(key.encode("utf-8")).digest()


def language_files(language: str) -> list[Path]:
    """One language's files: in hash order until they hold its budget, returned sorted by path. Empty when its
    root is missing or holds none."""
    root = roots()[language]
    if not root.is_dir():
        return []
    found: list[tuple[Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if language == "python":
            dirnames[:] = [d for d in dirnames if d not in _SKIP_PY]
        dirnames.sort()
        for f in filenames:
            path = Path(dirpath) / f
            if _wanted(language, path.relative_to(root).as_posix()) and path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if size:
                    found.append((path, size))
    budget, held, kept = (BUDGET_GZ if language == "man" else BUDGET), 0, []
    for path, size in sorted(found, key=lambda f: _score(key_of(f[0]))):
        if held >= budget:
            break
        kept.append(path)
        held += size
    return sorted(kept)


def source_files(source: str) -> list[Path]:
    """The files of ``lang:<language>`` / ``lang:all``, sorted by path."""
    return sorted(p for name in parse_source(source) for p in language_files(name))


def language_of(key: str) -> str:
    """The language a document key belongs to (its root's), or ``""``."""
    path = "/" + key
    for name, root in roots().items():
        if path.startswith(root.as_posix().rstrip("/") + "/"):
            return name
    return ""


def fingerprint(source: str) -> str:
    """A short digest of the files a language source holds (their keys and sizes): part of its cache key, so a
    machine with other packages installed prepares its own dataset."""
    digest = hashlib.sha256()
    for path in source_files(source):
        digest.update(f"{key_of(path)}\0{path.stat().st_size}\n".encode("utf-8"))
    return digest.hexdigest()[:12]


def missing(language: str) -> str | None:
    """Why this machine has none of a language's files (one line), or None."""
    root = roots()[language]
    if not root.is_dir():
        return f"{root} does not exist"
    if not language_files(language):
        return f"{root} holds no {language} files"
    return None


def check_language(source: str, where: str) -> None:
    """A cluster that trains on a language this machine lacks: one line."""
    for name in parse_source(source):
        if (why := missing(name)) is not None:
            raise DataError(f"{where}: data {source}: {why}; install {_INSTALL[name]}, point EDIT_TRAIN_LANG_ROOTS="
                            f"{name}=<dir> at a copy, or train this cluster on another language")


def present(sources: tuple[str, ...]) -> tuple[str, ...]:
    """The validation sources this machine holds; each missing language skipped with one warning line."""
    kept = []
    for source in sources:
        whys = [(n, w) for n in parse_source(source) if (w := missing(n)) is not None] \
            if is_language_source(source) else []
        if whys:
            log.warning("validation skips %s: %s", source, "; ".join(w for _, w in whys))
            continue
        kept.append(source)
    if not kept:
        raise DataError(f"validation: none of {', '.join(sources)} is on this machine; install one of "
                        f"{', '.join(_INSTALL.values())}")
    return tuple(kept)
