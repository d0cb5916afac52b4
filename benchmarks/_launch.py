"""How the benchmarks start processes: local gloo ranks, commands under one deadline, torchrun here or on netsim.

Launching side:

- :func:`run_ranks`: a function on N local processes joined in one gloo group on loopback;
- :func:`run_together`: several commands at once, each in its own session, every process group killed at the end;
- :func:`torchrun_local`: ``torchrun`` with N processes on this machine;
- :func:`simulated_cluster`, :func:`link_bandwidth` and :func:`torchrun_on_cluster`: the simulated cluster
  (``benchmarks/netsim.py``: network namespaces joined by ``tc``-shaped links; root and iproute2 needed), always
  taken down again, its link measured, and ``torchrun`` on every node at once; :func:`measured_cluster`: the first
  two together, as a comparison starts;
- :func:`launch_order`: the variants' turns, flipped every launch round.

A script that torchrun starts is its own worker: :func:`worker_command` adds ``--worker VARIANT --out PATH`` and the
settings the ranks need, and :func:`parse_or_work` runs the worker when the command line has them;
:func:`add_comparison_arguments` and :func:`add_mlp_arguments` declare the options such scripts share. The worker side:
:data:`QUIET_TRAINER`, :func:`cluster_trainer` (a quiet CPU Trainer for the processes torchrun started), :func:`mlp`
(the model) and :func:`fit_rank`.

Only the standard library is imported here at module level: a script's ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NETSIM = Path(os.environ.get("NETSIM", ROOT / "benchmarks" / "netsim.py"))
"""The simulated cluster's program: the repository's ``benchmarks/netsim.py`` (needs root, Linux and iproute2), an
executable file; ``$NETSIM`` names another with the same subcommands."""
NETSIM_COMMAND = [sys.executable, str(NETSIM)] if NETSIM.suffix == ".py" else [str(NETSIM)]
"""How :func:`netsim` starts :data:`NETSIM`: a Python file under this interpreter, anything else as it is."""

QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""The ``Trainer`` arguments of a timed run: nothing logged, saved or drawn beside the steps."""


RESULTS = ROOT / "benchmarks" / "results"
"""Where the stored results live; a ``--quick`` run writes elsewhere."""


def apply_quick(
    args: argparse.Namespace, parser: argparse.ArgumentParser, quick: dict[str, Any], default_json: str
) -> None:
    """Give ``args`` the settings of ``quick`` that the command line left at their defaults, and a ``--json`` named
    ``default_json`` in the temporary folder when none is given; refuse a ``--json`` among the stored results (a quick
    run replaces none)."""
    for name, value in quick.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    if args.json is None:
        args.json = Path(tempfile.gettempdir()) / default_json
    if args.json.resolve().parent == RESULTS:
        parser.error(f"--quick does not write into {RESULTS}: give --json another path (e.g. /tmp/{default_json})")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hide_gpus() -> None:
    """Hide the GPUs from this process and the ones it starts (unless ``CUDA_VISIBLE_DEVICES`` is set), for a script
    whose processes all run on the CPU: torch's ``powerSGD_hook`` synchronizes CUDA on the bucket's device whenever
    CUDA is available, which fails for CPU buckets. Call it before anything touches CUDA."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process: the repository root first on ``PYTHONPATH``, then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return {**env, **extra}


# ---------------------------------------------------------------------- local processes
def _rank(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple[Any, ...]) -> None:
    """One process of :func:`run_ranks`: joins the gloo group, runs ``fn(rank, world_size, *args)``, leaves it."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gc.freeze()  # the imported modules are left out of release_groups' collection: only what ``fn`` made is scanned
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    try:
        fn(rank, world_size, *args)
    finally:
        release_groups()


def release_groups() -> None:
    """Free what the rank's work left in reference cycles (a ``DistributedDataParallel`` holds its process group),
    then destroy the groups: the groups' worker threads are joined while the interpreter is whole. A group kept
    alive by an object freed only at interpreter exit aborts the process then (``terminate called without an
    active exception``) after its work is done."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one gloo group on loopback.

    The processes are forked from ``multiprocessing``'s fork server, which imports torch and the script once for
    all of a run's launches (a spawned rank would import them again at every launch); each rank is a process of
    its own, started after the server's imports and nothing else. ``fn`` must be a module-level function. Raises with
    the failing rank's traceback; with ``timeout`` (seconds), kills every rank and raises ``TimeoutError`` when they
    have not all finished by then, so a hung collective cannot hang the benchmark.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "__main__"])
    context = mp.start_processes(
        _rank, args=(fn, world_size, free_port(), args), nprocs=world_size, start_method="forkserver", join=False
    )
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    try:
        while not context.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout} s (a collective hung?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


@dataclass
class Finished:
    """What :func:`run_together` saw: each command's exit status and combined output, and the wall time."""

    codes: list[int]
    outputs: list[str]
    timed_out: bool
    seconds: float


def run_together(commands: Sequence[Sequence[str]], timeout: float, env: dict[str, str]) -> Finished:
    """Run ``commands`` at once from the repository root, each in its own session, under one deadline.

    On the deadline every process group is killed (a killed command's status is -9); at the end any process a command
    left behind (a launcher's ranks) is killed too. Nothing is raised for a failed command: the caller reads
    :class:`Finished`.
    """
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]
    outputs, timed_out = [], False
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, start + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
            outputs.append(out)
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait()
    return Finished([p.returncode for p in procs], outputs, timed_out, time.monotonic() - start)


def torchrun_local(nprocs: int, script: Sequence[str], what: str, timeout: float, **env: str) -> None:
    """``torchrun`` with ``nprocs`` processes on this machine, each running ``python SCRIPT...`` with one thread (and
    ``env`` added); raises ``RuntimeError`` with the output's tails when it fails."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nprocs)]
    run += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    full_env = child_env(OMP_NUM_THREADS="1", **env)
    done = subprocess.run([*run, *script], capture_output=True, text=True, env=full_env, check=False, timeout=timeout)
    if done.returncode != 0:
        logs = done.stdout[-3000:] + done.stderr[-3000:]
        raise RuntimeError(f"{what} failed (exit status {done.returncode}):\n{logs}")


# ---------------------------------------------------------------------- the simulated cluster
def netsim(*argv: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``netsim ARGV...`` (see :data:`NETSIM`), its output captured; ``check``: raise ``RuntimeError`` with what it
    printed (a refusal names its fix: run as root, install iproute2) when it fails."""
    done = subprocess.run([*NETSIM_COMMAND, *argv], capture_output=True, text=True, env=env, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"netsim {' '.join(argv)} failed (exit status {done.returncode}):\n{done.stderr}{done.stdout}"
        )
    return done


@contextmanager
def simulated_cluster(nodes: int, link: str) -> Iterator[None]:
    """``nodes`` simulated nodes joined by links of rate ``link`` (tc units: ``1gbit``) while the block runs; taken
    down at its end whatever happens, a failed start included."""
    try:
        netsim("up", str(nodes), link)
        yield
    finally:
        netsim("down", check=False)


def link_bandwidth() -> str:
    """The simulated link measured node 0 -> node 1, as netsim prints it (a failed probe gives its output, if any)."""
    return netsim("bandwidth", check=False).stdout.strip()


@contextmanager
def measured_cluster(nodes: int, link: str) -> Iterator[str]:
    """The :func:`simulated_cluster` of ``nodes`` nodes while the block runs, giving its link as measured once it is
    up (:func:`link_bandwidth`), the figure a comparison records beside its times."""
    with simulated_cluster(nodes, link):
        yield link_bandwidth()


def node_logs(folder: Path) -> str:
    """The last 3000 characters of each node's log that ``netsim torchrun`` wrote into ``folder``."""
    return "\n".join(p.read_text()[-3000:] for p in sorted(folder.glob("netsim-node*.log")))


def torchrun_on_cluster(per_node: int, script: Sequence[str], folder: Path, what: str, one_thread: bool = True) -> None:
    """``torchrun`` with ``per_node`` processes on every node of the simulated cluster that is up, each running
    ``python SCRIPT...``; the nodes' logs go to ``folder``. Raises ``RuntimeError`` with their tails when any fails.

    ``one_thread`` sets ``OMP_NUM_THREADS=1``: the simulated nodes share the machine's cores, and Lightning would
    otherwise give a lone process every core (torchrun sets 1 only for several processes a node). ``False`` leaves
    the thread count to torchrun and Lightning.
    """
    env = child_env(PYTHON=sys.executable, NETSIM_LOGS=str(folder))
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    done = netsim("torchrun", str(per_node), *script, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed on the simulated cluster:\n{node_logs(folder)}")


# ---------------------------------------------------------------------- a script as its own worker
def launch_order(variants: Sequence[str], index: int) -> list[str]:
    """The variants' turns in launch round ``index``: as given in even rounds, reversed in odd ones, so that a drift
    of the machine over a run hits every variant alike."""
    return list(variants) if index % 2 == 0 else list(reversed(variants))


def worker_command(script: str, variant: str, out: Path, args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """``SCRIPT --worker VARIANT --out OUT`` and ``--NAME VALUE`` for each of ``names`` in ``args``: the command line
    that makes ``script`` run one rank of ``variant`` (see :func:`parse_or_work`)."""
    command = [str(Path(script).resolve()), "--worker", variant, "--out", str(out)]
    for name in names:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return command


def parse_or_work(
    parser: argparse.ArgumentParser,
    worker: Callable[[argparse.Namespace], None],
    plot: Callable[[Path, Path], None] | None = None,
    figure: Path | None = None,
    figure_from: str | None = None,
) -> Any:
    """Parse the command line and return the arguments, or do what it asks for instead and return ``None``: a rank's
    work (``--worker VARIANT --out PATH``, hidden from ``--help``) is ``worker(args)``; with ``plot``, the options
    ``--plot STORED`` and ``--figure PATH`` draw the figure from a stored result (at ``figure`` by default).

    For a run, ``args.figure`` is where to draw its figure: the ``--figure`` given, else ``figure`` where the run's
    ``--json`` is the stored result the docs' figure is drawn from (``benchmarks/results/{figure_from}``), else
    ``None``: a scratch run, or another stored result of the same script, leaves the docs' figure alone."""
    if plot is not None:
        parser.add_argument("--plot", type=Path, help="draw the figure from this stored result and exit")
        parser.add_argument(
            "--figure", type=Path, help=f"where to draw the figure (default: {figure} for --plot or a stored result)"
        )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        release_groups()  # a rank that torchrun started ends with its groups destroyed, not at interpreter exit
        return None
    if plot is not None and args.plot:
        plot(args.plot, args.figure or figure)
        return None
    json_path = getattr(args, "json", None)
    stored = json_path is not None and figure_from is not None and Path(json_path).resolve() == RESULTS / figure_from
    if plot is not None and args.figure is None and stored:
        args.figure = figure
    return args


def add_mlp_arguments(parser: argparse.ArgumentParser) -> None:
    """``--width``, ``--depth`` and ``--batch``: the MLP a rank trains (``depth`` width x width layers) and the
    samples it takes a step, as :func:`fit_rank` reads them."""
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default: 12.6 M parameters at depth 12)")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")


def add_comparison_arguments(parser: argparse.ArgumentParser, variants: Sequence[str]) -> None:
    """The options of a comparison launched in interleaved rounds (:func:`launch_order`) on the MLP:
    ``--variants`` (default: all of ``variants``), ``--launches``, ``--steps``, ``--warmup``, the MLP's
    (:func:`add_mlp_arguments`), ``--bucket-cap-mb``, ``--json`` and ``--merge``."""
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=variants)
    parser.add_argument("--launches", type=int, default=2, help="launches of every variant, interleaved")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per launch")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    add_mlp_arguments(parser)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="the package's bucket cap (ddp keeps 25)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--merge", action="store_true", help="keep the cells of --json that this run does not measure")


def cluster_trainer(strategy: Any, max_steps: int, callbacks: list[Any]) -> Any:
    """A quiet CPU ``Trainer`` for a rank that torchrun started: processes a node and nodes from its environment
    (``LOCAL_WORLD_SIZE``, ``NNODES``)."""
    import lightning as L

    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["NNODES"]),
        max_steps=max_steps,
        callbacks=callbacks,
        **QUIET_TRAINER,
    )


def mlp(args: argparse.Namespace) -> Any:
    """The MLP of :func:`add_mlp_arguments` as a ``LightningModule``: ``args.depth`` layers ``Linear(width, width)``
    with tanh and a 10-class head (12.6 M parameters by default), cross-entropy, SGD with lr 0.01; ``net`` is the
    body ``hybrid_pipeline`` splits into stages (``pipeline_body``, ``pipeline_loss``)."""
    import lightning as L
    import torch
    from torch import nn

    class MLP(L.LightningModule):
        pipeline_body = "net"

        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = [nn.Linear(args.width, args.width) for _ in range(args.depth)]
            self.net = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())], nn.Linear(args.width, 10))

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(output, target)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return self.pipeline_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return MLP()


def fit_rank(
    model: Callable[[], Any],
    strategy: Callable[[], Any],
    callback: Any,
    args: argparse.Namespace,
    epoch_steps: int | None = None,
) -> tuple[Any, Any]:
    """Seed 0, build ``model()`` and fit it with ``strategy()`` on random 10-class data (``args.width`` features,
    seed 1, ``args.batch`` samples per rank and step) for ``args.steps`` steps under :func:`cluster_trainer`, the
    strategy made after the model and the data; returns the trainer and the module. The data makes one epoch of
    ``epoch_steps`` steps (default: ``args.steps``, a single epoch), passed over again until the last step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    module = model()
    samples = (epoch_steps or args.steps) * args.batch * int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(samples, args.width, generator=gen), torch.randint(0, 10, (samples,), generator=gen)
    )
    trainer = cluster_trainer(strategy(), args.steps, [callback])
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    return trainer, module
