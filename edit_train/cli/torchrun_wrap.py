"""`python -m edit_train.cli.torchrun_wrap LOG -- torchrun ARGS…`: run a cluster's torchrun so that a failure
ends in our one line, not in torchrun's own traceback.

`launchers/torchrun_multinode.sh` (and so the Slurm script) execs this in place of torchrun:

* everything torchrun and its workers print goes to LOG (appended, one header per launch) and to the console —
  except torchrun's own failure report (its log lines about failed / signalled workers and its traceback with
  the `ChildFailedError` table), which only LOG keeps; the workers already said what happened in one line;
* when torchrun fails and no worker said why (`error: …`), one line names its exit and LOG;
* torchrun dies with this process (parent-death signal) and its workers with torchrun (cli/parent.py: they
  know torchrun's pid, so one that was still starting when torchrun died ends too), so
  `kill -9` of the launcher leaves no worker training and holding its cluster's run lock; SIGTERM sent to this
  process is passed on to torchrun, which stops its workers (Ctrl-C reaches torchrun itself);
* a configuration error is not restarted: torchrun restarts a failed worker whatever its exit code
  (`MAX_RESTARTS` times: the same line again and again, a minute or more), so a worker that fails with the user
  error code (2, one `error: …` line said) first tells this wrapper through the file `$EDIT_TRAIN_NO_RESTART_FILE`
  (cli/train.py `no_restart`); the wrapper then stops torchrun and exits 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from edit_train.cli.parent import record_parent_and_die_with_it

# torchrun's own log lines (torch.distributed.elastic's: `E1128 01:02:03.456000 1234 torch/distributed/…] …`)
_TORCHRUN_LOG = re.compile(r"^(\[\w+\]:)?[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/|"
                           r"^(WARNING|ERROR|INFO):torch\.distributed")
_TORCHRUN_FRAME = re.compile(r"bin/torchrun|torch/distributed/(run|launcher|elastic)/?")


class Filter:
    """Splits torchrun's output: what the console shows, what only the log keeps."""

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self.console, self.log = console, log
        self.held: list[str] = []  # a traceback's first line, until its first frame says whose it is
        self.hidden = 0  # lines shown in the log only
        self.torchrun_failed = False  # from torchrun's traceback on, everything is its report
        self.said = False  # a worker said what went wrong in our one line (`error: …`)

    def line(self, text: str) -> None:
        self.log.write(text)
        self.log.flush()
        if self.torchrun_failed or _TORCHRUN_LOG.search(text):
            self.hidden += 1
            return
        if self.held:
            self.held.append(text)
            if _TORCHRUN_FRAME.search(text):
                self.torchrun_failed, self.hidden = True, self.hidden + len(self.held)
                self.held = []
            elif text.lstrip().startswith('File "<frozen runpy>"'):
                pass  # `python -m torch.distributed.run`: runpy's frames come first; the next frame says whose
            elif text.lstrip().startswith("File "):
                self._show(*self.held)
                self.held = []
            return
        if text.rstrip("\n").endswith("Traceback (most recent call last):"):
            self.held = [text]
            return
        self._show(text)

    def _show(self, *lines: str) -> None:
        self.said = self.said or any(text.startswith("error: ") for text in lines)
        self.console.writelines(lines)
        self.console.flush()

    def close(self) -> None:
        if self.held:
            self._show(*self.held)
            self.held = []


NO_RESTART_ENV = "EDIT_TRAIN_NO_RESTART_FILE"


def _stop_on_marker(proc: subprocess.Popen, marker: str, stopped: threading.Event) -> None:
    """Stop torchrun (SIGTERM: it stops its workers) once a worker wrote `marker`: its error is a configuration's."""
    while proc.poll() is None:
        if os.path.exists(marker):
            stopped.set()
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.1)


def _exit_line(code: int, log_path: str, hidden: int) -> str | None:
    where = f"torchrun's own report ({hidden} line(s)) is in {log_path}" if hidden else f"its output is in {log_path}"
    if code < 0:
        return f"torchrun was stopped by signal {-code} ({signal.Signals(-code).name}); {where}"
    if code == 0:
        return None
    return f"torchrun exited with code {code}; {where}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m edit_train.cli.torchrun_wrap LOG -- torchrun ARGS...", file=sys.stderr)
        return 2
    log_path, cmd = args[0], args[2:]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a", encoding="utf-8", errors="replace") as log, \
            tempfile.TemporaryDirectory(prefix="edit-train-torchrun-") as tmp:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S %z')} {' '.join(cmd)}\n")
        marker = os.path.join(tmp, "no_restart")
        os.environ[NO_RESTART_ENV] = marker  # torchrun and its workers inherit it (and torchrun's pid: preexec_fn)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=record_parent_and_die_with_it, text=True, errors="replace", bufsize=1)
        stopped = threading.Event()
        threading.Thread(target=_stop_on_marker, args=(proc, marker, stopped), daemon=True).start()

        def forward(signum: int, _frame: object) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        # Ctrl-C reaches torchrun directly (one process group), and torchrun passes it on to its workers: a second
        # SIGINT from here would make them give up their clean stop. Read on until torchrun has ended.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        out = Filter(sys.stderr, log)
        assert proc.stdout is not None
        for text in proc.stdout:
            out.line(text)
        out.close()
        code = proc.wait()
        if stopped.is_set():  # a worker's configuration error, said in its one line: not restarted
            log.write(f"==== a worker failed with a configuration error (exit 2): torchrun stopped, not restarted "
                      f"(it exited {code})\n")
            if not out.said:
                print(f"torchrun_multinode.sh: a worker failed with a configuration error; its output is in {log_path}",
                      file=sys.stderr, flush=True)
            return 2
        line = _exit_line(code, log_path, out.hidden)
        if line is not None:
            log.write(f"==== {line}\n")
        if line is not None and not (out.said and code > 0):  # a worker's line said it: that is the one line
            print(f"torchrun_multinode.sh: {line}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    raise SystemExit(main())
