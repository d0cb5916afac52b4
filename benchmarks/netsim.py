#!/usr/bin/env python3
"""A simulated cluster on one Linux machine: network namespaces joined by a bridge over ``tc``-shaped links.

Each node is a network namespace with its own loopback and one address (node ``i`` is ``10.77.0.{i+1}``), joined to
the others by a bridge that lives in a namespace of its own. Every node's link is shaped in both directions with a
token bucket (``tbf``): what the node sends on its end of the link, what it receives on the bridge's end. Processes
of one node talk over their loopback, unshaped; processes of different nodes cross the shaped link. The nodes share
the machine's CPU cores: this simulates the network, not the compute. Needs root and iproute2 (``ip``, ``tc``);
nothing is created in the machine's own namespace, so the cluster cannot collide with other interfaces.

Usage (``python benchmarks/netsim.py`` or ``benchmarks/netsim.py``)::

    netsim.py up 2 1gbit           # NODES >= 2, RATE in tc units (500mbit, 1gbit, 10gbit); DELAY (third) needs netem
    netsim.py bandwidth            # node 0 -> node 1 throughput over 64 MiB, timed by the receiver (1gbit: ~120 MB/s)
    netsim.py torchrun 2 train.py --my-args   # torchrun with 2 processes on every node at once; waits for all
    netsim.py exec 1 CMD...        # CMD on node 1 with MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES, NETSIM_ADDR
                                   # and GLOO_SOCKET_IFNAME set
    netsim.py link 1 down          # cut node 1's link (``up`` restores it): a node lost to the network
    netsim.py counters             # every node's bytes sent and received so far, read on the bridge's ends
    netsim.py status
    netsim.py down                 # remove every namespace it made (always, at the end)
    netsim.py --dry-run up 2 1gbit # print the ip/tc commands instead of running them (no root needed)

From Python, :class:`LinkSampler` records every node's link counters every few tens of milliseconds while a run
goes on, and :func:`peak_window` finds the most bytes in any one-second window of such a series.

Environment: ``PYTHON`` (the interpreter ``torchrun`` runs under; default this one), ``NETSIM_LOGS`` (where
``torchrun`` writes ``netsim-node{i}.log``; default ``/tmp``), ``NETSIM_PREFIX`` (the namespaces' name prefix,
default ``ldpsim``), ``NETSIM_PORT`` (the rendezvous port on node 0, default 29577). The cluster's shape is kept in
``/tmp/{prefix}.json`` between commands. Only the standard library is used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BURST = "256kb"
"""The token bucket's depth: a probe must move far more than this to see the rate (``bandwidth`` sends 64 MiB)."""
PROBE_BYTES = 64 << 20
PROBE_PORT = 29578


class NetsimError(SystemExit):
    """A refusal or failure with a message that says what to do; exits with status 2."""

    def __init__(self, message: str) -> None:
        print(f"netsim: {message}", file=sys.stderr)
        super().__init__(2)


@dataclass(frozen=True)
class Cluster:
    """The simulated cluster's shape: its namespaces' prefix, node count, link rate and one-way delay."""

    prefix: str
    nodes: int
    rate: str = "1gbit"
    delay: str = "0"

    @property
    def bridge(self) -> str:
        """The namespace that holds the bridge and the bridge's end of every link."""
        return f"{self.prefix}br"

    def namespace(self, node: int) -> str:
        """Node ``node``'s namespace."""
        return f"{self.prefix}{node}"

    @staticmethod
    def address(node: int) -> str:
        """Node ``node``'s address on the simulated network."""
        return f"10.77.0.{node + 1}"

    @staticmethod
    def interface(node: int) -> str:
        """Node ``node``'s end of its link, inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        return f"n{node}"


def state_file(prefix: str) -> Path:
    """Where ``up`` records the cluster for the later commands."""
    return Path("/tmp") / f"{prefix}.json"


def prefix() -> str:
    """The namespaces' name prefix (``$NETSIM_PREFIX``, default ``ldpsim``)."""
    return os.environ.get("NETSIM_PREFIX", "ldpsim")


def port() -> int:
    """The rendezvous port on node 0 (``$NETSIM_PORT``, default 29577)."""
    return int(os.environ.get("NETSIM_PORT", "29577"))


# ---------------------------------------------------------------------- the plan: which ip/tc commands
def shaping(namespace: str, device: str, cluster: Cluster) -> list[list[str]]:
    """The ``tc`` commands that shape ``device`` in ``namespace`` to the cluster's rate (and delay, through netem)."""
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
    tbf = ["tbf", "rate", cluster.rate, "burst", BURST, "latency", "50ms"]
    if cluster.delay in ("0", "0ms"):
        return [[*tc, "root", *tbf]]
    return [[*tc, "root", "handle", "1:", "netem", "delay", cluster.delay], [*tc, "parent", "1:", "handle", "2:", *tbf]]


def up_plan(cluster: Cluster) -> list[list[str]]:
    """Every command that builds ``cluster``, in order: the bridge's namespace, then per node its namespace, a veth
    pair made straight inside the two namespaces (nothing appears in the machine's own), the address, the shaping."""
    br = cluster.bridge
    plan = [["ip", "netns", "add", br], ["ip", "-n", br, "link", "add", "br0", "type", "bridge"]]
    plan.append(["ip", "-n", br, "link", "set", "br0", "up"])
    for i in range(cluster.nodes):
        ns, dev, end = cluster.namespace(i), cluster.interface(i), f"b{i}"
        plan.append(["ip", "netns", "add", ns])
        plan.append(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", end, "netns", br])
        plan.append(["ip", "-n", ns, "link", "set", "lo", "up"])
        plan.append(["ip", "-n", ns, "addr", "add", f"{cluster.address(i)}/24", "dev", dev])
        plan.append(["ip", "-n", ns, "link", "set", dev, "up"])
        plan.append(["ip", "-n", br, "link", "set", end, "master", "br0"])
        plan.append(["ip", "-n", br, "link", "set", end, "up"])
        plan += shaping(ns, dev, cluster)  # what the node sends
        plan += shaping(br, end, cluster)  # what the node receives
    return plan


def down_plan(cluster: Cluster) -> list[list[str]]:
    """The commands that remove ``cluster``: deleting a namespace deletes its veth ends and their shaping."""
    return [["ip", "netns", "del", cluster.namespace(i)] for i in range(cluster.nodes)] + [
        ["ip", "netns", "del", cluster.bridge]
    ]


# ---------------------------------------------------------------------- running it
def require_root_and_iproute2() -> None:
    """Refuse at once, naming the fix, unless this process is root and ``ip`` and ``tc`` are on the ``PATH``."""
    if os.geteuid() != 0:
        raise NetsimError(
            "needs root to make network namespaces and shape links with tc; run it as root "
            "(sudo -E python benchmarks/netsim.py ...), or skip the benchmarks that need the simulated cluster"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetsimError(
            f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2, dnf install iproute)"
        )


def run_plan(plan: Sequence[Sequence[str]], dry_run: bool, check: bool = True) -> bool:
    """Run (or with ``dry_run`` print) each command; with ``check``, stop at the first failure and return ``False``."""
    for command in plan:
        if dry_run:
            print(" ".join(command))
            continue
        done = subprocess.run(list(command), capture_output=True, text=True, check=False)
        if done.returncode != 0 and check:
            print(f"netsim: {' '.join(command)} failed: {done.stderr.strip()}", file=sys.stderr)
            return False
    return True


def netem_available(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on ``namespace``'s loopback and removed again)."""
    add = subprocess.run(
        ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
        capture_output=True,
        check=False,
    )
    subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    return add.returncode == 0


def up(nodes: str, rate: str, delay: str, dry_run: bool) -> None:
    """Build a cluster of ``nodes`` nodes with links of ``rate`` (and ``delay`` where the kernel has netem)."""
    if not nodes.isdigit() or int(nodes) < 2:
        raise NetsimError(f"NODES must be an integer >= 2, got {nodes!r}")
    cluster = Cluster(prefix(), int(nodes), rate, delay)
    if dry_run:
        run_plan(up_plan(cluster), dry_run=True)
        return
    require_root_and_iproute2()
    if state_file(cluster.prefix).exists():
        raise NetsimError(f"a simulated cluster is already up ({status_line()}): run 'netsim.py down' first")
    if delay not in ("0", "0ms"):
        subprocess.run(["ip", "netns", "add", cluster.bridge], capture_output=True, check=False)
        has_netem = netem_available(cluster.bridge)
        subprocess.run(["ip", "netns", "del", cluster.bridge], capture_output=True, check=False)
        if not has_netem:
            print(f"netsim: this kernel has no netem qdisc; links get bandwidth only, delay {delay} ignored")
            cluster = Cluster(cluster.prefix, cluster.nodes, rate, "0")
    if not run_plan(up_plan(cluster), dry_run=False):
        run_plan(down_plan(cluster), dry_run=False, check=False)
        raise NetsimError("could not build the cluster (see the failed command above); nothing is left behind")
    state_file(cluster.prefix).write_text(json.dumps(vars(cluster)))
    last = cluster.address(cluster.nodes - 1)
    print(
        f"netsim: {cluster.nodes} nodes (10.77.0.1-{last}), links {rate}, delay {cluster.delay}; "
        f"master 10.77.0.1:{port()}"
    )


def load() -> Cluster:
    """The cluster that ``up`` made, or a refusal that says to run ``up`` first."""
    path = state_file(prefix())
    if not path.exists():
        raise NetsimError("no simulated cluster: run 'netsim.py up NODES RATE' first")
    return Cluster(**json.loads(path.read_text()))


def status_line() -> str:
    """The cluster's nodes and shaping, one line."""
    cluster = load()
    return f"nodes: {cluster.nodes}, link: {cluster.rate} {cluster.delay}, namespaces {cluster.prefix}0.."


def leftover_nodes(cluster_prefix: str) -> int:
    """How many node namespaces of ``cluster_prefix`` exist (one past the highest index), half-built ones included."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    indices = [
        int(n[len(cluster_prefix) :])
        for n in names
        if n.startswith(cluster_prefix) and n[len(cluster_prefix) :].isdigit()
    ]
    return 1 + max(indices, default=-1)


def down(dry_run: bool) -> None:
    """Remove every namespace of the cluster (those of a half-built one too) and forget it."""
    path = state_file(prefix())
    nodes = json.loads(path.read_text())["nodes"] if path.exists() else 0
    if not dry_run:
        require_root_and_iproute2()
        nodes = max(nodes, leftover_nodes(prefix()))
    run_plan(down_plan(Cluster(prefix(), nodes)), dry_run, check=False)
    path.unlink(missing_ok=True)
    print("netsim: down")


def node_env(cluster: Cluster, node: int) -> dict[str, str]:
    """This process's environment plus what a process on ``node`` needs to find the others."""
    return {
        **os.environ,
        "MASTER_ADDR": cluster.address(0),
        "MASTER_PORT": str(port()),
        "NODE_RANK": str(node),
        "NNODES": str(cluster.nodes),
        "NETSIM_ADDR": cluster.address(node),
        "GLOO_SOCKET_IFNAME": cluster.interface(node),
    }


def in_node(cluster: Cluster, node: str | int, command: Sequence[str]) -> list[str]:
    """``command`` run inside node ``node``'s namespace (checked against the cluster's size)."""
    if not str(node).isdigit() or not 0 <= int(node) < cluster.nodes:
        raise NetsimError(f"NODE must be 0..{cluster.nodes - 1}, got {node!r}")
    return ["ip", "netns", "exec", cluster.namespace(int(node)), *command]


def link_plan(cluster: Cluster, node: int, state: str) -> list[list[str]]:
    """The command that takes node ``node``'s link ``state`` (``"up"`` or ``"down"``), from inside its namespace.

    Examples:
        >>> link_plan(Cluster("ldpsim", 2), 1, "down")
        [['ip', '-n', 'ldpsim1', 'link', 'set', 'n1', 'down']]
    """
    if state not in ("up", "down") or not 0 <= node < cluster.nodes:
        raise NetsimError(f"link takes a node 0..{cluster.nodes - 1} and 'up' or 'down', got {node} {state!r}.")
    return [["ip", "-n", cluster.namespace(node), "link", "set", cluster.interface(node), state]]


def exec_node(node: str, command: Sequence[str]) -> None:
    """Replace this process by ``command`` on node ``node``, with :func:`node_env`."""
    require_root_and_iproute2()
    cluster = load()
    argv = in_node(cluster, node, command)
    os.execvpe(argv[0], argv, node_env(cluster, int(node)))


def torchrun(per_node: str, script: Sequence[str]) -> int:
    """``torchrun`` with ``per_node`` processes on every node at once, a static rendezvous on node 0 and each agent
    bound to its node's address; waits for all and returns 1 if any failed (each node's output goes to
    ``$NETSIM_LOGS/netsim-node{i}.log``)."""
    require_root_and_iproute2()
    cluster = load()
    logs = Path(os.environ.get("NETSIM_LOGS", "/tmp"))
    python = os.environ.get("PYTHON", sys.executable)
    procs = []
    for node in range(cluster.nodes):
        run = [python, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes), "--node-rank", str(node)]
        run += ["--nproc-per-node", per_node, "--master-addr", cluster.address(0), "--master-port", str(port())]
        run += ["--local-addr", cluster.address(node), *script]
        with open(logs / f"netsim-node{node}.log", "w") as log:
            argv = in_node(cluster, node, run)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=node_env(cluster, node)))
    failed = [node for node, proc in enumerate(procs) if proc.wait() != 0]
    if failed:
        print(f"netsim: node(s) {failed} failed; logs in {logs}/netsim-node*.log", file=sys.stderr)
    return 1 if failed else 0


RECEIVER = f"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.2", {PROBE_PORT})); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); first = c.recv(1 << 20); t = time.perf_counter(); n = 0
while chunk := c.recv(1 << 20): n += len(chunk)
print(f"node0 -> node1: {{n / (time.perf_counter() - t) / 1e6:.0f}} MB/s")
"""
SENDER = f"""
import socket
s = socket.create_connection(("10.77.0.2", {PROBE_PORT})); b = b"x" * (1 << 20)
for _ in range({PROBE_BYTES >> 20} + 1): s.sendall(b)
s.close()
"""


def bandwidth() -> None:
    """Print node 0 -> node 1 throughput: 64 MiB timed by the receiver from its first byte to its last, far past the
    token bucket's burst allowance (a probe of a few MiB would see the burst, not the rate)."""
    require_root_and_iproute2()
    cluster = load()
    receiver = subprocess.Popen(
        in_node(cluster, 1, [sys.executable, "-c", RECEIVER]), stdout=subprocess.PIPE, text=True
    )
    assert receiver.stdout is not None
    try:
        if receiver.stdout.readline().strip() == "ready":  # listening
            subprocess.run(in_node(cluster, 0, [sys.executable, "-c", SENDER]), check=True, timeout=120)
            print(receiver.communicate(timeout=120)[0].strip())
    finally:
        receiver.kill()
        receiver.wait()


# ---------------------------------------------------------------------- link counters
COUNTERS = """
import sys, time
interval, names = float(sys.argv[1]), sys.argv[2:]
stats = [open(f"/sys/class/net/{n}/statistics/{k}_bytes") for n in names for k in ("rx", "tx")]
def read(f):
    f.seek(0)
    return f.read().strip()
while True:
    print(repr(time.time()), *map(read, stats), flush=True)
    if interval <= 0:
        break
    time.sleep(interval)
"""
"""Run in the bridge's namespace (where ``ip netns exec`` mounts its own ``/sys``): prints the wall time and, per
bridge end ``b{i}``, its received bytes (what node ``i`` sent) and its sent bytes (what node ``i`` received), every
``interval`` seconds (once for 0)."""


@dataclass
class LinkSampler:
    """Every node's link counters sampled every ``interval`` seconds from the bridge's namespace while it runs.

    ``start()`` launches one small sampler process (standard library only), ``stop()`` ends it and returns the
    samples: ``(wall time, [bytes node i sent so far], [bytes node i received so far])``, counted on the bridge's
    end of each link (Ethernet frames with their IP and TCP headers, as the link carries them).
    """

    cluster: Cluster
    interval: float = 0.05
    process: subprocess.Popen[str] | None = field(default=None, repr=False)
    output: Any = field(default=None, repr=False)  # a file, not a pipe: a pipe nobody reads fills and stalls it

    def command(self, interval: float) -> list[str]:
        """The sampler's command line (``interval`` 0: one sample)."""
        ends = [f"b{i}" for i in range(self.cluster.nodes)]
        return ["ip", "netns", "exec", self.cluster.bridge, sys.executable, "-c", COUNTERS, str(interval), *ends]

    def start(self) -> LinkSampler:
        """Start sampling (needs root and the cluster up)."""
        require_root_and_iproute2()
        self.output = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command(self.interval), stdout=self.output, text=True)
        return self

    def stop(self) -> list[tuple[float, list[int], list[int]]]:
        """Stop sampling; the samples taken."""
        if self.process is None:
            return []
        self.process.terminate()
        self.process.wait(timeout=30)
        self.output.seek(0)
        out = self.output.read()
        self.output.close()
        self.process = self.output = None
        return parse_counters(out)


def parse_counters(text: str) -> list[tuple[float, list[int], list[int]]]:
    """The samples in the sampler's output (a line cut short by ``stop`` is dropped).

    Examples:
        >>> parse_counters("1.5 10 20 30 40\\n1.6 11 21\\n")
        [(1.5, [10, 30], [20, 40])]
    """
    samples = []
    lines = [line.split() for line in text.splitlines()]
    width = max((len(f) for f in lines), default=0)
    for fields in lines:
        if len(fields) == width and width >= 3:
            values = [int(v) for v in fields[1:]]
            samples.append((float(fields[0]), values[0::2], values[1::2]))
    return samples


def peak_window(times: Sequence[float], counts: Sequence[float], window: float = 1.0) -> float:
    """The most a cumulative counter grew between two samples at most ``window`` seconds apart: the most bytes in any
    ``window`` of the series (sampled every ``interval``, it is seen to within an interval's bytes).

    Examples:
        >>> peak_window([0.0, 0.5, 1.0, 1.5, 2.0], [0, 0, 100, 300, 300])
        300.0
    """
    best, j = 0.0, 0
    for i in range(len(times)):
        j = max(j, i)
        while j + 1 < len(times) and times[j + 1] - times[i] <= window + 1e-9:
            j += 1
        best = max(best, float(counts[j] - counts[i]))
    return best


def counters() -> None:
    """Print every node's bytes sent and received so far."""
    require_root_and_iproute2()
    sampler = LinkSampler(load())
    out = subprocess.run(sampler.command(0), capture_output=True, text=True, check=True).stdout
    for _, sent, received in parse_counters(out):
        for node, (s, r) in enumerate(zip(sent, received, strict=True)):
            print(f"node {node}: sent {s} bytes, received {r} bytes")


USAGE = "\n".join(line for line in (__doc__ or "").split("Environment")[0].splitlines() if line.startswith("    "))
"""The subcommands, as the module's docstring lists them."""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch one subcommand (see the module's docstring); returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    dry_run = bool(args) and args[0] == "--dry-run"
    args = args[1:] if dry_run else args
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "up" and len(rest) <= 3:
        up(*(rest + ["2", "1gbit", "0"][len(rest) :]), dry_run=dry_run)
    elif command == "down":
        down(dry_run)
    elif command == "status":
        print(status_line())
    elif command == "bandwidth":
        bandwidth()
    elif command == "counters":
        counters()
    elif command == "link" and len(rest) == 2 and rest[0].isdigit():
        if not dry_run:
            require_root_and_iproute2()
        run_plan(link_plan(load(), int(rest[0]), rest[1]), dry_run)
    elif command == "exec" and len(rest) >= 2:
        exec_node(rest[0], rest[1:])
    elif command == "torchrun" and len(rest) >= 2:
        return torchrun(rest[0], rest[1:])
    else:
        print(f"usage:\n{USAGE}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
