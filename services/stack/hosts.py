"""Several "hosts" on one machine, for tests and for people: Linux network namespaces
joined through a router namespace, with the faults a real network has.

    router namespace (forwards, and is where faults are made)
      |-- h0 <veth> eth0 of host 0 (10.N.0.2)      each host: one namespace, one address,
      |-- h1 <veth> eth0 of host 1 (10.N.1.2)      its own loopback, default route via
      |-- ...                                      the router (10.N.i.1)
      `-- mgmt <veth> the machine's own namespace (10.N.254.2): where the client stands

Every address lies in one /16 (10.N.0.0/16) that no route of the machine's own namespace
covers when the fabric is made; the only route added there is the one to that /16 through
the management link, so traffic stays inside the namespaces made here. The router drops
silently where a real network would: a host whose link is down, or a pair of hosts
partitioned (`ip rule ... blackhole`), get no ICMP error and no RST, only silence. A link
can also be capped in bandwidth (`tbf`; this kernel has no `netem`, so delay comes only as
queueing behind a cap).

Needs root and iproute2; `unavailable()` says why a fabric cannot be made here.
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MGMT = 254  # the third octet of the management link's subnet
_LOCK = Path("/run/tandem-fabrics.lock")
_counter = itertools.count()


class FabricError(RuntimeError):
    """An `ip` command failed; the message names it and its output."""


@dataclass(frozen=True)
class Host:
    index: int
    netns: str  # the namespace's name (/run/netns/<netns>)
    address: str  # its one address, on eth0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise FabricError(f"ip {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the multi-host tests as root, as CI does)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` command"
    name = f"tdm-probe-{os.getpid()}"
    done = _ip("netns", "add", name, check=False)
    if done.returncode:
        return f"`ip netns add` failed here: {done.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_net() -> int:
    """A second octet N whose 10.N.0.0/16 no route of this namespace covers or touches."""
    routes = _ip("-4", "route", "show", "table", "all").stdout.split("\n")
    used = []
    for line in routes:
        word = line.split(" ", 1)[0]
        if word and word[0].isdigit():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for n in range(200, 250):
        net = ipaddress.ip_network(f"10.{n}.0.0/16")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return n
    raise FabricError("no free 10.N.0.0/16 (N in 200..249) for a fabric")


class Fabric:
    """`num_hosts` host namespaces behind one router namespace; `close()` removes them."""

    def __init__(self, num_hosts: int) -> None:
        if num_hosts < 1:
            raise ValueError(f"a fabric needs >= 1 host, got {num_hosts}")
        tag = f"{os.getpid() % 100000}{next(_counter)}"
        self.router = f"tdm{tag}-r"
        self._mgmt = f"tdm{tag}m"  # the management link's end in this namespace
        self.hosts: list[Host] = []
        self._caps: set[int] = set()
        self._made: list[str] = []
        _LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two fabrics made at once pick distinct nets
            self.net = _free_net()
            try:
                self._build(tag, num_hosts)
            except BaseException:
                self.close()
                raise

    def _build(self, tag: str, num_hosts: int) -> None:
        n, r = self.net, self.router
        _ip("netns", "add", r)
        self._made.append(r)
        _ip("-n", r, "link", "set", "lo", "up")
        _sysctl(r, "net.ipv4.ip_forward", "1")
        # Packets for a host whose link is down vanish instead of drawing an ICMP error.
        _ip("-n", r, "route", "add", "blackhole", f"10.{n}.0.0/16", "metric", "4000")
        _ip("link", "add", self._mgmt, "type", "veth", "peer", "name", "mgmt", "netns", r)
        _ip("addr", "add", f"10.{n}.{MGMT}.2/24", "dev", self._mgmt)
        _ip("link", "set", self._mgmt, "up")
        _ip("-n", r, "addr", "add", f"10.{n}.{MGMT}.1/24", "dev", "mgmt")
        _ip("-n", r, "link", "set", "mgmt", "up")
        _ip("route", "add", f"10.{n}.0.0/16", "via", f"10.{n}.{MGMT}.1", "dev", self._mgmt)
        for i in range(num_hosts):
            ns = f"tdm{tag}-h{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", r, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)  # fmt: skip
            _ip("-n", r, "addr", "add", f"10.{n}.{i}.1/24", "dev", f"h{i}")
            _ip("-n", r, "link", "set", f"h{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"10.{n}.{i}.2/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.{n}.{i}.1")
            self.hosts.append(Host(i, ns, f"10.{n}.{i}.2"))

    @property
    def client_address(self) -> str:
        """This (the machine's own) namespace's address on the fabric."""
        return f"10.{self.net}.{MGMT}.2"

    def exec_prefix(self, host: int) -> list[str]:
        """argv prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.hosts[host].netns]

    # --- faults ----------------------------------------------------------------------------

    def link_down(self, host: int) -> None:
        """Cut `host` off from everyone (its cable pulled at the router)."""
        _ip("-n", self.router, "link", "set", f"h{host}", "down")

    def link_up(self, host: int) -> None:
        _ip("-n", self.router, "link", "set", f"h{host}", "up")
        # The connected route comes back with the link; nothing else to restore.

    def _rule(self, verb: str, src: int, dst: int) -> None:
        a, b = self.hosts[src].address, self.hosts[dst].address
        priority = str(100 + src * 256 + dst)
        _ip("-n", self.router, "rule", verb, "from", a, "to", b, "blackhole",
            "priority", priority, check=verb == "add")  # fmt: skip

    def block(self, src: int, dst: int, both_ways: bool = True) -> None:
        """Drop packets from `src` to `dst` silently (and back, unless `both_ways` is
        False: a half-open path, where one side's packets arrive and the other's vanish)."""
        self._rule("add", src, dst)
        if both_ways:
            self._rule("add", dst, src)

    def unblock(self, src: int, dst: int, both_ways: bool = True) -> None:
        """Undo `block` (a pair not blocked is left as it is)."""
        self._rule("del", src, dst)
        if both_ways:
            self._rule("del", dst, src)

    def cap(self, host: int, mbit: float) -> None:
        """Cap `host`'s link to `mbit` megabits a second each way (a token bucket with a
        short queue: a sender is held back by TCP, not by a deep buffer at the router)."""
        rate = f"{mbit}mbit"
        for ns, dev in ((self.router, f"h{host}"), (self.hosts[host].netns, "eth0")):
            _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", "16kb", "latency", "100ms")  # fmt: skip
        self._caps.add(host)

    def uncap(self, host: int) -> None:
        for ns, dev in ((self.router, f"h{host}"), (self.hosts[host].netns, "eth0")):
            _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        self._caps.discard(host)

    def backlog_bytes(self, host: int) -> int:
        """Bytes queued at the router toward `host` behind its cap (0 when uncapped): a
        transfer is under way on a capped link exactly while this is large."""
        out = _ip("netns", "exec", self.router, "tc", "-s", "qdisc", "show", "dev", f"h{host}")
        words = out.stdout.split()
        for i, word in enumerate(words[:-1]):
            if word == "backlog":
                return _bytes(words[i + 1])
        return 0

    def close(self) -> None:
        """Remove every namespace and the management link (processes still inside lose
        their network; stop them first)."""
        _ip("link", "del", self._mgmt, check=False)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def state(self) -> dict:
        """What `from_state` needs to manage (and remove) this fabric from another process
        (`python -m services.stack down`)."""
        return {
            "net": self.net, "router": self.router, "mgmt": self._mgmt, "made": self._made,
            "hosts": [[h.index, h.netns, h.address] for h in self.hosts],
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: dict) -> Fabric:
        fabric = cls.__new__(cls)
        fabric.net, fabric.router, fabric._mgmt = state["net"], state["router"], state["mgmt"]
        fabric._made = list(state["made"])
        fabric.hosts = [Host(i, ns, address) for i, ns, address in state["hosts"]]
        fabric._caps = set()
        return fabric

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _sysctl(netns: str, key: str, value: str) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    done = subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", f"echo {value} > {path}"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise FabricError(f"sysctl {key}={value} in {netns}: {done.stderr.strip()}")


def _bytes(text: str) -> int:
    """tc's byte counts: '1234b', '12Kb', '3Mb'."""
    scale = {"Kb": 1024, "Mb": 1024 * 1024, "b": 1}
    for suffix, factor in scale.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)
