"""Hosts on one Linux box: each a network namespace with its own address and its own hostname resolving to
it, joined by a bridge whose links are shaped with `tc tbf` — the multi-host test tier and the link benchmark.

A loopback run hides what a real deployment meets: a hostname that resolves to the LAN address (or Debian's
127.0.1.1), traffic that must leave the host, a link of finite rate that can go down. Here a *host* is

* a network namespace `<run id>-<name>` with `lo` up and one veth into the run's bridge, address 10.213.K.i/24;
* its own UTS namespace (every command runs under `unshare --uts` with `hostname <name>`), and its own
  `/etc/hosts` (`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over /etc/hosts) that maps every host's
  name to its address — so `socket.gethostname()` resolves to the host's LAN address, as on a cluster node;
* a link shaped to `rate_mbit` both ways (tbf on each end of its veth: real TCP at a set rate; the kernels
  here have no netem, so latency is not modelled).

`cut(name)` takes a host's link down (a partition), `kill(name)` SIGKILLs every process in its namespace (a
host's death). Everything is removed on `close()` (also after a failed test), and `sweep()` removes what a
killed earlier run left: every object carries the run id, and /run/edit-train-hosts/<run id> holds the pid
of the process that built it. Needs root, `ip netns`, bridges, `tc tbf` and `unshare`; `unavailable()` says
in one line why not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts every file of /etc/netns/<ns>/ over /etc/<file>
OWNERS = Path("/run/edit-train-hosts")  # <run id>: the pid that built the run (sweep() keeps live owners' runs)
PREFIX = "eth"  # every object of this module: netns "eth<id>-<host>", links "eth<id>…", bridge "eth<id>b"
SUBNET = "10.213"  # the third octet is drawn per run


def _ip(*args: str, ns: str | None = None, check: bool = True, tool: str = "ip") -> subprocess.CompletedProcess[str]:
    """`ip ARGS` (or `tc ARGS`), in namespace `ns` when given."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [tool, *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """None when this box can build hosts; else one line saying why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    try:
        subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=True, timeout=30)
        try:
            subprocess.run(["ip", "netns", "exec", probe, "ip", "link", "add", "p0", "type", "veth", "peer",
                            "name", "p1"], capture_output=True, check=True, timeout=30)
            subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
                            "100mbit", "burst", "64kb", "latency", "200ms"], capture_output=True, check=True,
                           timeout=30)
            subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], capture_output=True,
                           check=True, timeout=30)
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"network namespaces, veth, tc tbf or UTS namespaces do not work here ({detail.decode().strip() or exc})"
    return None


def sweep() -> list[str]:
    """Remove the namespaces, links and hosts files of earlier runs whose owner process is gone."""
    removed: list[str] = []
    owners: dict[str, int] = {}
    for f in OWNERS.glob(f"{PREFIX}*") if OWNERS.is_dir() else []:
        try:
            owners[f.name] = int(f.read_text())
        except (OSError, ValueError):
            owners[f.name] = 0
    names = _ip("netns", "list", check=False).stdout.split()
    runs = {n.split("-", 1)[0] for n in names if n.startswith(PREFIX) and "-" in n} | set(owners)
    runs |= {d.name.split("-", 1)[0] for d in NETNS_ETC.glob(f"{PREFIX}*-*")} if NETNS_ETC.is_dir() else set()
    for run in runs:
        if _alive(owners.get(run, 0)):
            continue
        for ns in (n for n in names if n.startswith(run + "-")):
            _kill_ns(ns)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", run + "b", check=False)
        for d in NETNS_ETC.glob(f"{run}-*"):
            shutil.rmtree(d, ignore_errors=True)
        (OWNERS / run).unlink(missing_ok=True)
        removed.append(run)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Hosts:
    """Hosts `names` on one bridge (`with Hosts(["lh", "a", "b"]) as hosts: hosts.popen("a", [...])`)."""

    def __init__(self, names: list[str], rate_mbit: float | None = 100.0) -> None:
        if len(set(names)) != len(names) or not all(n.isalnum() and n.islower() and len(n) <= 8 for n in names):
            raise ValueError(f"host names must be distinct, lowercase alphanumeric, at most 8 characters: {names}")
        sweep()
        self.id = PREFIX + secrets.token_hex(2)
        self.names = list(names)
        self.rate_mbit = rate_mbit
        self.bridge = self.id + "b"
        octet = 1 + secrets.randbelow(254)  # any: each run's hosts are alone on their own bridge
        self.addresses = {n: f"{SUBNET}.{octet}.{i + 1}" for i, n in enumerate(names)}
        self._procs: list[subprocess.Popen[Any]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- build / tear down
    def ns(self, name: str) -> str:
        return f"{self.id}-{name}"

    def _build(self) -> None:
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.id).write_text(str(os.getpid()))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addresses.items())
        for i, name in enumerate(self.names):
            ns, inner, outer = self.ns(name), f"{self.id}h{i}", f"{self.id}p{i}"
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            _ip("netns", "add", ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"{self.addresses[name]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            if self.rate_mbit:
                self._shape(inner, ns)
                self._shape(outer, None)

    def _shape(self, dev: str, ns: str | None) -> None:
        rate = f"{self.rate_mbit:g}mbit"
        # burst: at least one 10 ms worth of bytes (tbf needs rate/HZ); latency bounds the queue
        burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))
        _ip("qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "400ms", ns=ns,
            tool="tc")

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for name in getattr(self, "names", []):
            _kill_ns(self.ns(name))
            _ip("netns", "del", self.ns(name), check=False)
            shutil.rmtree(NETNS_ETC / self.ns(name), ignore_errors=True)
        if hasattr(self, "bridge"):
            _ip("link", "del", self.bridge, check=False)
            (OWNERS / self.id).unlink(missing_ok=True)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- use
    def argv(self, name: str, cmd: list[str]) -> list[str]:
        """`cmd` as run on host `name`: in its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.ns(name), "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', name, *cmd]

    def popen(self, name: str, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start `cmd` on host `name` (its own process group; killed at close)."""
        proc = subprocess.Popen(self.argv(name, cmd), start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(self, name: str, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        kw.setdefault("timeout", 120)
        return subprocess.run(self.argv(name, cmd), **kw)

    def address(self, name: str) -> str:
        return self.addresses[name]

    def cut(self, name: str) -> None:
        """Take host `name`'s link down: it can reach nobody, nobody reaches it (a partition)."""
        _ip("link", "set", f"{self.id}p{self.names.index(name)}", "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", f"{self.id}p{self.names.index(name)}", "up")

    def kill(self, name: str) -> None:
        """SIGKILL every process on host `name` (the host dies; its namespace and address stay)."""
        _kill_ns(self.ns(name))
        time.sleep(0.2)
