"""torchft's Lighthouse where only the gate reaches it: a child process in a network namespace of its own.

torchft's Lighthouse has no authentication, and its quorum rule counts every heartbeating name (askers must
outnumber half of them): a local user who can reach it, even without the federation key, could heartbeat
made-up names into it and hold back every quorum. So the gate (`gate.py`) does not start it in its own
process: it starts this module as a child that enters a new user and network namespace (`unshare`, no
privileges needed where the kernel allows user namespaces), brings up that namespace's loopback, starts the
Lighthouse there and serves the gate's heartbeats and quorum requests over a socket pair only the two
processes hold. Nothing outside the child's namespace can connect to the Lighthouse or its dashboard.

Where the kernel refuses user namespaces the child runs the Lighthouse on the host's loopback as before and
says so (`isolated` is False, `why` tells the reason); the gate logs it once.

Wire format on the socket pair: one JSON object per line, each request with an `id` its answer repeats; the
child answers requests concurrently (a quorum request waits for the quorum). Only the standard library and
torchft's compiled module are imported here: the child starts in well under a second.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


class InnerError(RuntimeError):
    """The inner Lighthouse failed a request (torchft's own message) or is gone."""


class InnerLighthouse:
    """The gate's handle on the child: `heartbeat(name)`, `quorum(...)` (a dict), `shutdown()`."""

    def __init__(self, min_clusters: int, join_timeout_s: float, heartbeat_timeout_s: float,
                 isolate: bool = True) -> None:
        mine, theirs = socket.socketpair()
        args = [sys.executable, "-I", os.path.abspath(__file__), str(theirs.fileno()), str(int(min_clusters)),
                str(int(join_timeout_s * 1000)), str(int(heartbeat_timeout_s * 1000)), "1" if isolate else "0"]
        self._proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock, self._reader = mine, mine.makefile("r", encoding="utf-8")
        self._lock, self._next = threading.Lock(), 1
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        hello = self._reader.readline()
        if not hello:
            self.shutdown()
            raise InnerError("torchft's Lighthouse did not start (its process exited)")
        first = json.loads(hello)
        if "error" in first:
            self.shutdown()
            raise InnerError(str(first["error"]))
        self.address: str = first["address"]  # inside the child's namespace when isolated
        self.isolated: bool = bool(first["isolated"])
        self.why: str = str(first.get("why", ""))
        threading.Thread(target=self._read, name="edit-train-inner-lighthouse", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._reader:
                msg = json.loads(line)
                with self._lock:
                    slot = self._waiting.pop(int(msg.get("id", -1)), None)
                if slot is not None:
                    slot[1].append(msg)
                    slot[0].set()
        except (OSError, ValueError):  # closed by shutdown(), or the child died mid-line
            pass
        with self._lock:  # the child is gone: every waiting request fails
            waiting, self._waiting = self._waiting, {}
        for ev, out in waiting.values():
            out.append({"error": "torchft's Lighthouse process exited"})
            ev.set()

    def _ask(self, op: str, **kw: Any) -> dict[str, Any]:
        ev, out = threading.Event(), []  # type: ignore[var-annotated]
        with self._lock:
            rid, self._next = self._next, self._next + 1
            self._waiting[rid] = (ev, out)
            try:
                self._sock.sendall((json.dumps({"id": rid, "op": op, **kw}) + "\n").encode())
            except OSError as exc:
                self._waiting.pop(rid, None)
                raise InnerError(f"torchft's Lighthouse process is gone: {exc}") from None
        ev.wait()
        if "error" in out[0]:
            raise InnerError(str(out[0]["error"]))
        return out[0]

    def heartbeat(self, name: str) -> None:
        self._ask("heartbeat", name=name)

    def quorum(self, name: str, store: str, step: int, size: int, data: dict[str, Any],
               timeout_s: float) -> dict[str, Any]:
        """{"quorum_id", "created": [seconds, nanos], "participants": [{replica_id, store_address, step,
        world_size, data}]} (InnerError with torchft's message on a timeout)."""
        return self._ask("quorum", name=name, store=store, step=step, size=size, data=data, timeout_s=timeout_s)

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# ----------------------------------------------------------------------------------- the child
def _enter_namespace() -> str:
    """Enter a new user + network namespace and bring its loopback up; '' on success, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            break
    else:
        return f"the kernel refused a private network namespace ({os.strerror(ctypes.get_errno())})"
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, siocgifflags, struct.pack("16sH14s", b"lo", 0, bytes(14)))
        flags = struct.unpack("16sH", got[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, bytes(14)))
    return ""


def _torchft() -> Any:
    """torchft's compiled module alone (its package imports torch: seconds this child does not need)."""
    import importlib.util

    spec = importlib.util.find_spec("torchft")
    if spec is None or spec.origin is None:
        raise ImportError("torchft is not installed")
    folder = os.path.dirname(spec.origin)
    so = next(f for f in os.listdir(folder) if f.startswith("_torchft") and f.endswith(".so"))
    mod_spec = importlib.util.spec_from_file_location("torchft._torchft", os.path.join(folder, so))
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _serve(fd: int, min_clusters: int, join_ms: int, heartbeat_ms: int, isolate: bool) -> None:
    import datetime

    sock = socket.socket(fileno=fd)
    out_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        with out_lock:
            try:
                sock.sendall((json.dumps(msg) + "\n").encode())
            except OSError:  # the gate is gone: the reader below ends this process
                pass

    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C / a group's SIGTERM is the gate's to handle: this
        signal.signal(sig, signal.SIG_IGN)       # child ends when the gate closes its end (or dies)

    why = _enter_namespace() if isolate else "isolation turned off"
    try:
        ft = _torchft()
        server = ft.LighthouseServer(bind="127.0.0.1:0", min_replicas=min_clusters, join_timeout_ms=join_ms,
                                     quorum_tick_ms=50, heartbeat_timeout_ms=heartbeat_ms)
        loopback = f"127.0.0.1:{str(server.address()).rpartition(':')[2]}"
        client = ft.LighthouseClient(f"http://{loopback}", datetime.timedelta(seconds=10))
    except Exception as exc:  # noqa: BLE001 - reported to the gate in one line
        send({"id": 0, "error": f"cannot start torchft's Lighthouse: {str(exc).strip().splitlines()[0]}"})
        return
    send({"id": 0, "address": loopback, "isolated": not why, "why": why})

    def one(req: dict[str, Any]) -> None:
        rid = req.get("id")
        try:
            if req["op"] == "heartbeat":
                client.heartbeat(req["name"])
                send({"id": rid, "ok": True})
                return
            q = client.quorum(replica_id=req["name"], timeout=datetime.timedelta(seconds=float(req["timeout_s"])),
                              address=req["name"], store_address=req["store"], step=int(req["step"]),
                              world_size=int(req["size"]), shrink_only=False, data=req["data"])
            created = getattr(q, "created", None)
            send({"id": rid, "quorum_id": int(q.quorum_id),
                  "created": [int(getattr(created, "seconds", 0)), int(getattr(created, "nanos", 0))],
                  "participants": [{"replica_id": str(m.replica_id), "store_address": str(m.store_address),
                                    "step": int(m.step), "world_size": int(m.world_size),
                                    "data": dict(m.data or {})} for m in q.participants]})
        except Exception as exc:  # noqa: BLE001 - torchft reports a timeout as a RuntimeError
            send({"id": rid, "error": str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)})

    try:
        with sock.makefile("r", encoding="utf-8") as reader:
            for line in reader:  # the gate closing its end (or dying) ends the child
                threading.Thread(target=one, args=(json.loads(line),), daemon=True).start()
    except (OSError, ValueError):
        pass
    server.shutdown()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
