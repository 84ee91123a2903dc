"""The standard library split by package family: a non-IID corpus every machine has.

Every ``*.py`` file of this interpreter's standard library (site-packages and ``__pycache__`` left out; tests,
idlelib and lib2to3 kept, unlike the default ``stdlib`` source) belongs to exactly one *family*, decided by its
top-level package or module name (``email/...`` and ``smtplib.py`` are ``net``); a name no family lists is
``core``. A data source ``stdlib:<family>[+<family>...]`` is those families' files; ``stdlib:all`` is every
family. Document keys stay relative to the standard library's root and each family is split into train/val on
its own (`corpus.planned_sides`), so a document is in the val split of every source that holds it or of none:
``stdlib:net+systems`` has exactly the val documents of ``stdlib:net`` and ``stdlib:systems`` together.

`GROUPS` says which families each cluster of an N-cluster ``data.split=by_family`` run trains on.
Sizes on CPython 3.11 (bytes = byte-tokenizer tokens; without the test suite, idlelib, tkinter and lib2to3
that some distributions ship separately): net 1.93 M, systems 1.39 M, dev 22.1 M (2.4 M without them),
core 6.07 M (5.2 M) — each above the 1.02 M tokens a cluster reads in the convergence benchmark's longest
setting (1000 steps x 8 sequences x 128 tokens), see docs/noniid.md.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from .tokenizer import DataError

PREFIX = "stdlib:"
# top-level package / module names of each family; every other name is `core`
FAMILIES: dict[str, tuple[str, ...]] = {
    "net": ("email", "http", "urllib", "xml", "html", "json", "xmlrpc", "wsgiref", "mailbox", "mailcap",
            "mimetypes", "smtplib", "smtpd", "imaplib", "poplib", "ftplib", "nntplib", "telnetlib", "cgi", "cgitb",
            "netrc", "ipaddress", "socketserver", "webbrowser", "uu", "quopri", "base64", "binhex", "_markupbase",
            "nturl2path"),
    "systems": ("asyncio", "concurrent", "multiprocessing", "threading", "_threading_local", "queue", "sched",
                "selectors", "subprocess", "_bootsubprocess", "signal", "socket", "ssl", "asyncore", "asynchat",
                "contextvars", "os", "shutil", "tempfile", "io", "_pyio", "pty", "tty", "getpass"),
    "dev": ("test", "unittest", "doctest", "pdb", "bdb", "trace", "tracemalloc", "profile", "cProfile", "pstats",
            "timeit", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc", "pydoc_data", "code",
            "codeop", "cmd", "rlcompleter", "tabnanny", "pyclbr", "py_compile", "compileall", "dis", "symtable",
            "modulefinder"),
    "core": (),
}
NAMES = tuple(FAMILIES)
# data.split=by_family: the families each cluster trains on, by the number of clusters
GROUPS: dict[int, tuple[tuple[str, ...], ...]] = {
    2: (("net", "systems"), ("dev", "core")),
    3: (("net", "systems"), ("dev",), ("core",)),
    4: (("net",), ("systems",), ("dev",), ("core",)),
}
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_OWNER = {name: family for family, names in FAMILIES.items() for name in names}


def family_of(key: str) -> str:
    """The family of a file named by its path relative to the standard library's root."""
    top = key.split("/", 1)[0] if "/" in key else key.removesuffix(".py")
    return _OWNER.get(top, "core")


def is_family_source(source: str | None) -> bool:
    return source is not None and source.startswith(PREFIX)


def parse_source(source: str) -> tuple[str, ...]:
    """The families of ``stdlib:<family>[+<family>...]`` (``stdlib:all``: every one), in `NAMES` order."""
    spec = source[len(PREFIX):]
    names = NAMES if spec == "all" else tuple(spec.split("+"))
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise DataError(f"data source {source!r}: unknown standard-library family {unknown or [spec]}; use "
                        f"stdlib:<family>[+<family>...] with families {', '.join(NAMES)}, or stdlib:all")
    return tuple(n for n in NAMES if n in names)


def source_of(families: Sequence[str]) -> str:
    """The data source of these families (`parse_source`'s inverse, in `NAMES` order)."""
    return PREFIX + "+".join(n for n in NAMES if n in families)


def group_sources(clusters: int) -> list[str]:
    """The training source of each cluster of a ``data.split=by_family`` run of `clusters` clusters."""
    if clusters not in GROUPS:
        raise DataError(f"data.split=by_family: defined for {', '.join(map(str, GROUPS))} clusters, this run has "
                        f"{clusters}; name each cluster's data in cluster.clusters[i].data.source=stdlib:<family> "
                        f"(families {', '.join(NAMES)}) instead")
    return [source_of(g) for g in GROUPS[clusters]]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def family_files(source: str) -> list[Path]:
    """The files of a family source, sorted by path."""
    wanted = set(parse_source(source))
    root = stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for f in filenames:
            path = Path(dirpath) / f
            if f.endswith(".py") and family_of(path.relative_to(root).as_posix()) in wanted:
                found.append(path)
    return sorted(found)
