"""`edit-train-prepare` on generated corpora larger than its memory use (issue 39, acceptance 4).

For each size a JSONL corpus of random-word documents (1–4 KB each) is generated under ``--dir``; then

* ``edit-train-prepare CORPUS --out DS --workers N`` runs as a subprocess while this script samples the RSS of its
  whole process tree (parent + pool workers, summed) every 0.2 s: the peak must not grow with the corpus;
* on the first size, a second run is killed (SIGKILL to its process group) once it has finished some pieces and
  is run again: it must resume (its line says how many pieces it kept) and write byte-identical shards;
* tokens/s is what the command reports (tokens written ÷ its wall time, start-up included).

Corpora and datasets are deleted after each size (the disk is shared).

    python benchmarks/prepare_scale.py --sizes-gb 0.5,2 --workers 2 --out results/prepare_scale.json
    python benchmarks/prepare_scale.py --quick      # 0.1 and 0.4 GB
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def make_corpus(path: Path, size_bytes: int, seed: int = 0, pool_words: int = 4_000_000) -> int:
    """JSONL of random-word documents up to ``size_bytes``; returns the number of documents."""
    rng = np.random.default_rng(seed)
    words = np.array([("w%d" % i).encode() for i in range(5000)] + [b"the", b"of", b"and", b"a", b"to"] * 400)
    pool = b" ".join(words[rng.integers(0, len(words), pool_words)])  # ~20 MB of text to cut documents from
    n = written = 0
    with open(path, "wb") as fh:
        while written < size_bytes:
            starts = rng.integers(0, len(pool) - 4096, 1000)
            lengths = rng.integers(1000, 4000, 1000)
            block = b"".join(b'{"text": "' + pool[s:s + ln] + b'", "id": %d}\n' % (n + i)
                             for i, (s, ln) in enumerate(zip(starts, lengths)))
            fh.write(block)
            written += len(block)
            n += 1000
    return n


def _tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_prepare(corpus: Path, out: Path, workers: int, tokenizer: str,
                kill_when_pieces: int | None = None) -> dict[str, Any]:
    """One ``edit-train-prepare`` run, sampled; with ``kill_when_pieces``, SIGKILLed once that many pieces are done."""
    cmd = [sys.executable, "-m", "edit_train.cli.prepare", str(corpus), "--out", str(out), "--workers", str(workers),
           "--tokenizer", tokenizer, "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    peak, killed = 0, False
    partial = out.parent / f"{out.name}.partial"
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        if kill_when_pieces is not None and len(list(partial.glob("p0*.json"))) >= kill_when_pieces:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if killed:
        return {"killed_after_pieces": len(list(partial.glob("p0*.json"))), "wall_s": wall, "peak_tree_rss": peak}
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr[-2000:]}")
    line = stdout.strip().splitlines()[-1]
    rate = re.search(r"([\d,]+) tokens/s on (\d+) process", line)
    resumed = re.search(r"(\d+) of (\d+) pieces resumed", line)
    meta = json.loads((out / "meta.json").read_text())
    return {"wall_s": wall, "peak_tree_rss": peak, "line": line,
            "tokens": sum(meta["splits"][s]["tokens"] for s in ("train", "val")),
            "tokens_per_s": int(rate.group(1).replace(",", "")) if rate else None,
            "processes": int(rate.group(2)) if rate else None,
            "resumed_pieces": int(resumed.group(1)) if resumed else 0, "pieces": int(resumed.group(2)) if resumed else None}


def digest(data_dir: Path) -> str:
    """SHA-256 over both splits' token streams."""
    meta = json.loads((data_dir / "meta.json").read_text())
    h = hashlib.sha256()
    for split in ("train", "val"):
        for name in meta["splits"][split]["files"]:
            with open(data_dir / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
        h.update(b"|")
    return h.hexdigest()


def main() -> None:
    p = C.parser(__doc__, out="prepare_scale.json")
    p.add_argument("--sizes-gb", default="0.5,2", help="corpus sizes in GB (default 0.5,2)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokenizer", default="byte", help="byte (default) or a tokenizer.json")
    p.add_argument("--dir", default=None, help="where corpora and datasets go (default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="0.1 and 0.4 GB")
    args = C.parse(p)
    sizes = [0.002] if args.smoke else [0.1, 0.4] if args.quick else [float(x) for x in args.sizes_gb.split(",")]
    root = Path(tempfile.mkdtemp(prefix="prepare-scale-", dir=args.dir or C.SMOKE))
    rows = []
    try:
        for i, gb in enumerate(sizes):
            corpus = root / f"corpus-{gb}gb.jsonl"
            t0 = time.perf_counter()
            docs = make_corpus(corpus, int(gb * 1e9), pool_words=100_000 if args.smoke else 4_000_000)
            row: dict[str, Any] = {"size_gb": gb, "corpus_bytes": corpus.stat().st_size, "documents": docs,
                                   "generate_s": round(time.perf_counter() - t0, 1), "loadavg_before": os.getloadavg()}
            row["run"] = run_prepare(corpus, root / "ds", args.workers, args.tokenizer)
            if i == 0 and not args.smoke:  # kill midway, run again: resumes, same shards (a smoke's is one piece)
                killed = run_prepare(corpus, root / "ds2", args.workers, args.tokenizer,
                                     kill_when_pieces=3)
                again = run_prepare(corpus, root / "ds2", args.workers, args.tokenizer)
                row["kill_and_resume"] = {"killed": killed, "rerun": again,
                                          "identical_to_uninterrupted": digest(root / "ds2") == digest(root / "ds")}
            row["loadavg_after"] = os.getloadavg()
            rows.append(row)
            r = row["run"]
            print(f"{gb:4.1f} GB ({docs:,} docs): peak RSS of the process tree {r['peak_tree_rss'] / 1e6:,.0f} MB, "
                  f"{r['tokens_per_s']:,} tokens/s on {r['processes']} processes, {r['wall_s']:.0f} s"
                  + (f"; killed after {row['kill_and_resume']['killed']['killed_after_pieces']} pieces, rerun resumed "
                     f"{row['kill_and_resume']['rerun']['resumed_pieces']} of {row['kill_and_resume']['rerun']['pieces']}"
                     f", identical: {row['kill_and_resume']['identical_to_uninterrupted']}"
                     if "kill_and_resume" in row else ""), flush=True)
            for d in (corpus, root / "ds", root / "ds2"):
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "prepare_scale", "tokenizer": args.tokenizer, "workers": args.workers, "rows": rows,
              "command": " ".join(["python", "benchmarks/prepare_scale.py", *sys.argv[1:]]),
              "host": {"cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg()}}
    print(f"wrote {C.write_json(args.out, result)}")


if __name__ == "__main__":
    main()
