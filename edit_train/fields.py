"""Checks of single configuration values that need more than a type: host addresses (resolved at
validation time, with a deadline) and cluster names (the gate's safe character set). `ConfigError` lives
here so that `config.py` and these checks share it without an import cycle."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
import threading
from typing import Any


class ConfigError(ValueError):
    """A configuration a user can fix; the message names the field."""



def _need(cond: bool, field_name: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {why}")


def _check_finite(field_name: str, value: Any, *, zero: str = "", unit: str = "seconds",
                   example: float | None = None) -> None:
    """`value` is a finite number of `unit` > 0 (or >= 0 when `zero` says what 0 means), else a ConfigError
    naming `field_name` and what to give instead: `inf` would never time out (or overflow a deadline), `nan`
    compares false with everything (a wait that never ends), a negative duration is no duration."""
    floor = ">= 0" if zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field_name}: must be a number of {unit} {floor}, got {value!r}")
    hint = f" (e.g. {field_name}={example:g})" if example is not None else ""
    zero_hint = f"; 0 means {zero}" if zero else ""
    if math.isnan(value) or math.isinf(value):
        raise ConfigError(f"{field_name}: must be a finite number of {unit} {floor}, got {value}; give a number"
                          f"{hint}{zero_hint}")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{field_name}: must be {floor} {unit}, got {value:g}; give a positive number{hint}"
                          f"{zero_hint}")


_RESOLVE_TIMEOUT_S = 5.0
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,15}")


def _show(value: str) -> str:
    """`value` for a one-line message: as is when it is plain printable ASCII, else its (escaped) repr."""
    return value if re.fullmatch(r"[\x21-\x7e]{1,200}", value) else repr(value)[:200]


def _split_address(value: str, need_port: bool) -> tuple[str, int | None]:
    """(host, port) of `host`, `host:port`, `[v6]:port` (optionally `scheme://` first when a port is
    needed); ValueError saying why not. A bare IPv6 address is accepted only without a port."""
    rest = value
    if need_port and "://" in rest:
        scheme, _, rest = rest.partition("://")
        if not _SCHEME.fullmatch(scheme):
            raise ValueError("a bad scheme before ://")
    port: str | None = None
    if rest.startswith("["):
        host, sep, after = rest[1:].partition("]")
        if not sep or (after and not after.startswith(":")):
            raise ValueError("an unclosed or misplaced [ ]")
        port = after[1:] if after else None
        if ":" not in host:
            raise ValueError("only an IPv6 address goes in [ ]")
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    elif rest.count(":") > 1 and need_port:
        raise ValueError("an IPv6 address with a port goes in [ ]: [ADDRESS]:PORT")
    else:
        host = rest
    if need_port and port is None:
        raise ValueError("no :PORT")
    if not need_port and port is not None:
        raise ValueError("an address to bind to, without a port")
    if port is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
            raise ValueError("the port is not a number from 1 to 65535")
    if not host:
        raise ValueError("no host")
    return host, int(port) if port is not None else None


def _check_host(field_name: str, value: Any, need_port: bool) -> None:
    """`value` is a syntactically valid host[:port] whose host resolves (socket.getaddrinfo), else ConfigError
    naming `field_name`: an address literal is resolved numerically (no DNS, instant), localhost is taken as
    is, a name is looked up in a thread for at most _RESOLVE_TIMEOUT_S seconds."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{field_name}: must be a host{':port' if need_port else ''}, got {value!r}")
    form = "host:port" if need_port else "host name or address (no port)"
    if not value.isprintable() or any(ch.isspace() for ch in value):
        raise ConfigError(f"{field_name}: {_show(value)} is not a valid {form} (spaces or control characters)")
    try:
        host, _ = _split_address(value, need_port)
    except ValueError as exc:
        raise ConfigError(f"{field_name}: {_show(value)} is not a valid {form} ({exc})") from None
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    if not literal:
        name = host[:-1] if host.endswith(".") else host
        labels = name.split(".")
        if len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise ConfigError(f"{field_name}: {_show(value)} is not a valid {form} (a host name is dot-separated "
                              "labels of letters, digits, - and _, at most 63 characters each)")
        if labels[-1].isdigit():
            raise ConfigError(f"{field_name}: {_show(value)} does not resolve (not a valid IPv4 address, and a "
                              "host name cannot end in a number)")
    if host == "localhost":
        return
    result: list[BaseException | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM,
                               flags=socket.AI_NUMERICHOST if literal else 0)
            result.append(None)
        except Exception as exc:  # noqa: BLE001 - gaierror, or a name the resolver refuses (UnicodeError, ...)
            result.append(exc)

    if literal:  # the common loopback case: a numeric address needs no DNS, so nothing can wait
        lookup()
    else:
        thread = threading.Thread(target=lookup, name="edit-train-resolve", daemon=True)
        thread.start()
        thread.join(_RESOLVE_TIMEOUT_S)
    if not result:
        raise ConfigError(f"{field_name}: {_show(value)} does not resolve (no answer within "
                          f"{_RESOLVE_TIMEOUT_S:g} s)")
    if result[0] is not None:
        why = str(result[0]).strip().splitlines()[0] if str(result[0]).strip() else type(result[0]).__name__
        raise ConfigError(f"{field_name}: {_show(value)} does not resolve ({why})")


def check_host_here(field_name: str, host: str) -> None:
    """ConfigError when `host` (an address this process binds, `federation.host`) is not an address of this
    machine: binding it is tried (port 0, closed at once) before anything is started on it."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{field_name}: {_show(host)} does not resolve on this machine ({exc}); nothing was "
                          "started") from None
    last: OSError | None = None
    for family, kind, proto, _name, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(addr)
            return
        except OSError as exc:
            last = exc
    why = last.strerror if last is not None and last.strerror else str(last)
    raise ConfigError(f"{field_name}: {_show(host)} is not an address of this machine ({socket.gethostname()}): "
                      f"binding it fails ({why}); nothing was started and no run state changed: set "
                      f"{field_name} (or EDIT_TRAIN_HOST) to this machine's address on the clusters' network")


def _check_cluster_name(field_name: str, name: Any) -> None:
    from edit_train.federation.gate import valid_name  # the gate admits exactly these names

    _need(valid_name(name), field_name,
          f"{_show(str(name))} is not a cluster name: 1-64 letters, digits, '_', '-', and single '.' between "
          "them (it names directories and the cluster in the federation)")
