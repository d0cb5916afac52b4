"""Benchmark the ring all-reduce against the backend's own all-reduce, and the strategy against Lightning's DDP.

(a) ``ring_all_reduce`` vs ``torch.distributed.all_reduce`` for 64 KiB to 64 MiB (fp32, average), 2 processes,
    interleaved with the same ring over one connection (``one``: no ``duplex`` group, as it ran before there was
    one) and with plain exchanges of the ring's messages (no arithmetic), in several fresh launches; prints median
    times, the median over launches of the ratio (ours / torch's) with its range, and bus bandwidth
    (bytes * 2(N-1)/N / time, the figure NCCL's tests report). ``ring`` is the ring as the strategies run it: with
    the second group :func:`~lightning_dp_strategies.comm.new_duplex_group` makes at two ranks.
(b) Trainer step time of ``"ring_allreduce"`` vs ``"ddp"`` on the same ~20 M parameter MLP, 2 processes (one
    ``torchrun`` launch; inside it the two strategies take turns, one ``Trainer.fit`` each per round, the order flipped
    every round), steady state (the first third of each fit is warm-up); prints the median of the per-round ratios.
(c) The same Trainer run with each reducer and compression wrapper (``ring``, ``native``, ``bf16_compress``,
    ``fp16_compress``, ``PowerSGD("ring", rank=4)``, ``PowerSGD("native", rank=4)``), with torch's DDP communication
    hooks on the same buckets (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``
    at rank 4) and with Lightning's ``"ddp"``, all in one launch: bytes sent per step and step time, relative to
    plain ``ring`` and to ``ddp``. Then the cost model's prediction of when compression pays
    (:mod:`lightning_dp_strategies.plan.compression`): the loopback link fitted on a few ring all-reduces, the
    compression's compute per step measured at world 1 on the same buckets, the predicted against the measured
    ratios at 2 ranks, and predictions at 8 ranks for 1, 10 and 100 Gbit/s.

Usage::

    python benchmarks/bench_ring_allreduce.py            # both parts
    python benchmarks/bench_ring_allreduce.py --part a   # collectives only
    python benchmarks/bench_ring_allreduce.py --part c   # reducers and compression
    python benchmarks/bench_ring_allreduce.py --part a --json benchmarks/results/ring_allreduce_a.json  # also store it
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _launch import hide_gpus, run_ranks, torchrun_local
from _results import Report

hide_gpus()  # every process here runs on the CPU over gloo

SIZES = [64 * 1024 * 4**k for k in range(6)]  # 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB


def _plain_exchanges(data: torch.Tensor, scratch: torch.Tensor) -> None:
    """The ring's messages and nothing else: 2(N-1) blocking exchanges of one chunk, straight on the process group.

    No reduction, no pipelining, no bookkeeping: what moving the ring's bytes with point-to-point operations costs on
    this backend by itself. Where this alone is slower than ``all_reduce``, the gap is the transport's, not the
    ring's arithmetic. (Not a lower bound: the ring's own schedule can beat it.)
    """
    pg = dist.group.WORLD
    assert pg is not None
    size, rank = pg.size(), pg.rank()
    chunk = -(-data.numel() // size)
    for _ in range(2 * (size - 1)):
        recv = pg.recv([scratch[:chunk]], (rank - 1) % size, 0)
        send = pg.send([data[:chunk]], (rank + 1) % size, 0)
        recv.wait()
        send.wait()


def _torch_average(data: torch.Tensor, world: int) -> None:
    from lightning_dp_strategies.comm import divide_

    dist.all_reduce(data)
    divide_(data, world)  # the ring's own division (a multiply for a power of two): neither side gains from it


def _collectives(rank: int, world: int, repeats: int, sizes: list[int], out: str) -> None:
    from lightning_dp_strategies.comm import new_duplex_group, ring_all_reduce, ring_workspace_numel

    duplex = new_duplex_group()  # as the strategies do: a second connection at two ranks, None otherwise
    torch.set_num_threads(1)
    results = []
    for nbytes in sizes:
        data = torch.randn(nbytes // 4)
        workspace = torch.empty(ring_workspace_numel(data.numel(), world))  # reused, as the RingReducer does
        calls: dict[str, Callable[[], object]] = {
            "ring": functools.partial(ring_all_reduce, data, "avg", workspace=workspace, duplex=duplex),
            "one": functools.partial(ring_all_reduce, data, "avg", workspace=workspace),
            "torch": functools.partial(_torch_average, data, world),
            "p2p": functools.partial(_plain_exchanges, data, workspace),
        }
        for call in calls.values():  # warm-up
            for _ in range(3):
                call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        reps = max(5, min(repeats, (256 * 1024 * 1024) // nbytes))  # 40 rounds up to 4 MiB, 5 at 64 MiB
        for i in range(reps):  # interleaved, the order rotated every round, so drift hits all alike
            names = list(calls)[i % len(calls) :] + list(calls)[: i % len(calls)]
            for name in names:
                dist.barrier()
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
        results.append({"bytes": nbytes, **{f"{k}_s": statistics.median(v) for k, v in times.items()}})
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 1024 * 1024 else f"{nbytes // 1024 // 1024} MiB"


def part_a(world: int, repeats: int, launches: int, sizes: list[int]) -> list[dict[str, float]]:
    """Each launch is a fresh pair of processes; on a small VM a launch's thread placement moves every figure in it
    by up to 2x, so the ratio is the median over launches of each launch's ratio (medians of interleaved calls)."""
    runs = []
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "a.json")
            run_ranks(_collectives, world, repeats, sizes, out)
            runs.append(json.loads(Path(out).read_text()))
    print(f"\n(a) ring_all_reduce vs torch.distributed.all_reduce (gloo, fp32, average), {world} processes,")
    print(f"    {launches} launches; ratio = median over launches of ring / torch (min-max across launches);")
    print("    ring = as the strategies run it (at 2 processes each direction over its own connection: duplex group);")
    print("    one = the same ring over one connection (no duplex group), its median ratio to torch;")
    print("    p2p = the ring's messages as plain blocking exchanges, no arithmetic (what the transport alone costs)")
    print(
        f"{'size':>9} {'ring ms':>9} {'torch ms':>9} {'p2p ms':>9} {'ratio':>6} {'range':>11}"
        f" {'one/torch':>10} {'p2p/torch':>10} {'ring busbw':>11} {'torch busbw':>12}"
    )
    factor = 2 * (world - 1) / world
    summary = []
    table: list[list[str]] = []
    for i, nbytes in enumerate(sizes):
        rows = [run[i] for run in runs]
        ms = {k: statistics.median(r[f"{k}_s"] for r in rows) * 1e3 for k in ("ring", "torch", "p2p")}
        ratios = [r["ring_s"] / r["torch_s"] for r in rows]
        ratio, p2p = statistics.median(ratios), statistics.median(r["p2p_s"] / r["torch_s"] for r in rows)
        one = statistics.median(r["one_s"] / r["torch_s"] for r in rows)
        bus = [nbytes * factor / (ms[k] / 1e3) / 1e9 for k in ("ring", "torch")]
        print(
            f"{_size(nbytes):>9} {ms['ring']:9.3f} {ms['torch']:9.3f} {ms['p2p']:9.3f} {ratio:6.2f}"
            f" {min(ratios):5.2f}-{max(ratios):<5.2f} {one:10.2f} {p2p:10.2f} {bus[0]:6.2f} GB/s {bus[1]:7.2f} GB/s"
        )
        summary.append({"bytes": nbytes, "ratio": ratio, "one_ratio": one, "p2p_ratio": p2p, **ms})
        table.append(
            [
                _size(nbytes),
                f"{ms['ring']:.3f}",
                f"{ms['torch']:.3f}",
                f"{ms['p2p']:.3f}",
                f"{ratio:.2f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
                f"{one:.2f}",
                f"{p2p:.2f}",
                f"{bus[0]:.2f} GB/s",
                f"{bus[1]:.2f} GB/s",
            ]
        )
    columns = ["size", "ring ms", "torch ms", "p2p ms", "ring/torch", "range", "one/torch", "p2p/torch"]
    columns += ["ring busbw", "torch busbw"]
    title = f"(a) ring_all_reduce against torch.distributed.all_reduce (gloo, fp32, average), {world} processes"
    _record(title, columns, table, [f"{launches} launches; ratio = median over launches of ring / torch"])
    return summary


TRAIN_SCRIPT = """
import gc, json, statistics, sys, time
import lightning as L, torch
from torch import nn
import lightning_dp_strategies
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from lightning_dp_strategies import PowerSGD, RingAllReduceStrategy, bf16_compress, fp16_compress
REDUCERS = {"ring": "ring", "native": "native", "bf16": lambda: bf16_compress("ring"),
            "fp16": lambda: fp16_compress("ring"), "powersgd": lambda: PowerSGD("ring", rank=4),
            "powersgd_native": lambda: PowerSGD("native", rank=4)}
# torch's DDP communication hooks on the package's buckets; PowerSGD at the package's rank 4, compressing from the
# third step (torch requires start_powerSGD_iter > 1 with error feedback), so every timed step is compressed
HOOKS = {"allreduce": lambda: (default_hooks.allreduce_hook, None, None),
         "fp16": lambda: (default_hooks.fp16_compress_hook, None, None),
         "bf16": lambda: (default_hooks.bf16_compress_hook, None, None),
         "powersgd": lambda: (powerSGD_hook.powerSGD_hook,
                              powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2),
                              None)}

class Timer(L.Callback):
    def __init__(self): self.t = []; self.start = 0.0
    def on_train_batch_start(self, *a): self.start = time.perf_counter()
    def on_train_batch_end(self, *a): self.t.append(time.perf_counter() - self.start)

class MLP(L.LightningModule):
    def __init__(self, width, depth):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())],
                                 nn.Linear(width, 10))
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=1e-3)

def make(strategy):
    if strategy.startswith("hook:"):  # a fresh hook state per fit
        hook, state, wrapper = HOOKS[strategy.split(":", 1)[1]]()
        return RingAllReduceStrategy(ddp_comm_hook=hook, ddp_comm_state=state, ddp_comm_wrapper=wrapper)
    if "+" not in strategy:
        return strategy
    reducer = REDUCERS[strategy.split("+", 1)[1]]  # ring_allreduce+<reducer>
    return RingAllReduceStrategy(reducer=reducer if isinstance(reducer, str) else reducer())

strategies, rounds, steps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
width, depth, out = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64 * steps, width, generator=g), torch.randint(0, 10, (64 * steps,), generator=g)
data = torch.utils.data.TensorDataset(x, y)
fits = {s: [] for s in strategies}
stats, params = {}, 0
for r in range(rounds):  # both in the same two processes, the order flipped every round
    for strategy in strategies if r % 2 == 0 else strategies[::-1]:
        timer, model = Timer(), MLP(width, depth)
        trainer = L.Trainer(strategy=make(strategy), accelerator="cpu", devices=2, max_steps=steps, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            callbacks=[timer])
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))
        fits[strategy].append(statistics.median(timer.t[steps // 3 :]))  # the first third is warm-up
        step_stats = getattr(trainer.strategy, "step_stats", None)
        stats[strategy] = step_stats.as_dict() if step_stats else None
        params = sum(p.numel() for p in model.parameters())
        shapes = [list(p.shape) for p in model.parameters()]
if trainer.global_rank == 0:
    json.dump({"fits": fits, "params": params, "shapes": shapes, "stats": stats}, open(out, "w"))
# the groups destroyed while the interpreter is whole: a group the last fit's objects keep until interpreter exit can
# abort the process then ("terminate called without an active exception"), after the work is done
del trainer, model
gc.collect()
torch.distributed.destroy_process_group()
"""


def _train_runs(strategies: list[str], steps: int, width: int, depth: int, rounds: int) -> dict[str, Any]:
    """Per strategy, the median steady-state step time of each of ``rounds`` Trainer fits, all in one launch.

    ``torchrun`` starts the two processes once; inside them the strategies take turns, one fit each per round, the
    order flipped every round. So every round compares the strategies on the same processes, cores and moment, and
    the per-round ratios show how much of a single comparison is noise (a shared 2-core VM drifts by 30% and more).
    """
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "train.py", Path(tmp) / "fits.json"
        script.write_text(TRAIN_SCRIPT)
        argv = [str(script), ",".join(strategies), str(rounds), str(steps), str(width), str(depth), str(out)]
        torchrun_local(2, argv, "the training launch", timeout=3600, PYTHONWARNINGS="ignore")
        return json.loads(out.read_text())


def _paired(result: dict[str, Any], name: str, base: str) -> tuple[float, list[float], float, float]:
    """(median step time of ``name``, the per-round ratios ``name / base``, their median, their IQR)."""
    ratios = [a / b for a, b in zip(result["fits"][name], result["fits"][base], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return statistics.median(result["fits"][name]), ratios, statistics.median(ratios), q3 - q1


def part_b(steps: int, width: int, depth: int, rounds: int) -> float:
    result = _train_runs(["ring_allreduce", "ddp"], steps, width, depth, rounds)
    ring, ratios, ratio, spread = _paired(result, "ring_allreduce", "ddp")
    ddp = statistics.median(result["fits"]["ddp"])
    steady = steps - steps // 3
    print(
        f"\n(b) Trainer step time, 2 processes on CPU/gloo, MLP with {result['params'] / 1e6:.1f} M parameters, "
        f"batch 32/rank; {rounds} rounds of one fit each, alternating in one launch"
    )
    print(f"  ring_allreduce  {ring * 1e3:8.1f} ms/step (median over fits of the median of {steady} steady steps)")
    print(f"  ddp             {ddp * 1e3:8.1f} ms/step")
    print("  per-round ratios " + " ".join(f"{r:.2f}" for r in ratios))
    notes = ["per-round ratios " + " ".join(f"{r:.2f}" for r in ratios)]
    stats = result["stats"]["ring_allreduce"]
    if stats:
        line = (
            f"ring_allreduce per step: {stats['bytes_sent'] / 1e6:.1f} MB sent, {stats['ring_operations']:.0f} "
            f"buckets ({stats['overlapped_buckets']:.0f} started during backward), "
            f"{stats['exposed_seconds'] * 1e3:.1f} ms exposed"
        )
        print("  " + line)
        notes.append(line)
    line = (
        f"ratio ring_allreduce / ddp = {ratio:.3f} (median of the per-round ratios, IQR {spread:.3f}; target <= 1.05)"
    )
    print("  " + line)
    notes.append(line)
    title = (
        f"(b) Trainer step time, 2 processes on CPU/gloo, MLP with {result['params'] / 1e6:.1f} M parameters, "
        f"batch 32/rank, {rounds} alternating rounds"
    )
    rows = [["ring_allreduce", f"{ring * 1e3:.1f}"], ["ddp", f"{ddp * 1e3:.1f}"]]
    _record(title, ["strategy", f"ms/step (median of {steady} steady steps)"], rows, notes)
    return ratio


PART_C = {  # row key in the launch -> (label, bytes: "counted" by the strategy or the known "payload")
    "ring_allreduce+ring": ('"ring"', "counted"),
    "ring_allreduce+native": ('"native"', "counted"),
    "ring_allreduce+bf16": ('bf16_compress("ring")', "counted"),
    "ring_allreduce+fp16": ('fp16_compress("ring")', "counted"),
    "ring_allreduce+powersgd": ('PowerSGD("ring", rank=4)', "counted"),
    "ring_allreduce+powersgd_native": ('PowerSGD("native", rank=4)', "counted"),
    "hook:allreduce": ("hook allreduce_hook", "counted"),
    "hook:fp16": ("hook fp16_compress_hook", "payload"),
    "hook:bf16": ("hook bf16_compress_hook", "payload"),
    "hook:powersgd": ("hook powerSGD_hook r=4", "payload"),
    "ddp": ('Lightning "ddp"', "payload"),
}
# row -> (compression method for plan.compression, dependent reductions per bucket, baseline row of the same transport)
COMPRESSED = {
    "ring_allreduce+bf16": ("bf16", 1, "ring_allreduce+ring"),
    "ring_allreduce+fp16": ("fp16", 1, "ring_allreduce+ring"),
    "ring_allreduce+powersgd": ("powersgd", 2, "ring_allreduce+ring"),
    "ring_allreduce+powersgd_native": ("powersgd", 2, "ring_allreduce+native"),
    "hook:fp16": ("fp16", 1, "hook:allreduce"),
    "hook:bf16": ("bf16", 1, "hook:allreduce"),
    "hook:powersgd": ("powersgd", 3, "hook:allreduce"),
}


def _row_bytes(result: dict[str, Any], key: str, world: int) -> float:
    """Bytes per step and rank: as the strategy counted them, or (torch hooks, whose traffic the adapter cannot see,
    and ``ddp``) the known payload of the method priced as a bandwidth-optimal all-reduce, 2(N-1)/N of it."""
    from lightning_dp_strategies.plan.compression import payload_bytes
    from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank

    if PART_C[key][1] == "counted":
        return float(result["stats"][key]["bytes_sent"])
    method = COMPRESSED[key][0] if key in COMPRESSED else "none"
    return ring_bytes_per_rank(payload_bytes(result["shapes"], method, rank=4), world)


def _fit_loopback(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Links fitted on 2-rank all-reduces of ``sizes`` (medians of interleaved calls, one launch): the package's ring
    (the transport of its reducers) and gloo's all_reduce (what torch's hooks and ``"native"`` use)."""
    from lightning_dp_strategies.plan import Link
    from lightning_dp_strategies.plan.sizing import ring_bytes_per_rank

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "link.json")
        run_ranks(_collectives, 2, repeats, sizes, out)
        rows = json.loads(Path(out).read_text())
    return {
        name: Link.fit([(2, ring_bytes_per_rank(r["bytes"], 2), r[f"{key}_s"]) for r in rows])
        for name, key in (("ring", "ring"), ("gloo", "torch"))
    }


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _compression_compute(width: int, depth: int, steps: int) -> dict[str, float]:
    """Seconds per step of each contender's local work on the benchmark model's buckets, at world 1 (one gloo process,
    so the all-reduces move nothing), one thread as in the Trainer runs: the median of ``steps`` interleaved steps.

    Each compressing contender's *extra* compute is its time minus its uncompressed baseline's (``COMPRESSED``).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_dp_strategies import PowerSGD, bf16_compress, fp16_compress
    from lightning_dp_strategies.plan.sizing import bucket_boundaries
    from lightning_dp_strategies.reducers import GradBucket, close_reducer, resolve_reducer, setup_reducer
    from lightning_dp_strategies.reducers.comm_hooks import HookBucket

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        params = list(_mlp(width, depth).parameters())
        layout = bucket_boundaries([("f32", p.numel() * 4) for p in params])  # the strategies' buckets, 25/1 MiB
        sources = [torch.randn(sum(params[i].numel() for i in idx)) for idx in layout]
        buffers = [src.clone() for src in sources]
        reducers = {
            "ring_allreduce+ring": resolve_reducer("ring"),
            "ring_allreduce+native": resolve_reducer("native"),
            "ring_allreduce+bf16": bf16_compress("ring"),
            "ring_allreduce+fp16": fp16_compress("ring"),
            "ring_allreduce+powersgd": PowerSGD("ring", rank=4),
            "ring_allreduce+powersgd_native": PowerSGD("native", rank=4),
        }
        psgd = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        hooks = {
            "hook:allreduce": (default_hooks.allreduce_hook, dist.group.WORLD),
            "hook:fp16": (default_hooks.fp16_compress_hook, dist.group.WORLD),
            "hook:bf16": (default_hooks.bf16_compress_hook, dist.group.WORLD),
            "hook:powersgd": (powerSGD_hook.powerSGD_hook, psgd),
        }
        for reducer in reducers.values():
            setup_reducer(reducer, dist.group.WORLD, [0], "gloo")

        def step(name: str) -> float:
            for buffer, src in zip(buffers, sources, strict=True):
                buffer.copy_(src)
            start = time.perf_counter()
            futures = []
            for k, idx in enumerate(layout):
                owned, last = [params[i] for i in idx], k == len(layout) - 1
                if name in reducers:
                    bucket = GradBucket(buffers[k], dist.group.WORLD, index=k, shapes=[p.shape for p in owned])
                    bucket.params, bucket.last = owned, last
                    futures.append(reducers[name](bucket))
                else:
                    hook, state = hooks[name]
                    futures.append(hook(state, HookBucket(k, last, buffers[k], owned)))
                    if name == "hook:powersgd":  # one bucket at a time, as CommHookReducer runs hooks
                        futures[-1].wait()
            for future in futures:
                future.wait()
            return time.perf_counter() - start

        names = [*reducers, *hooks]
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(steps + 3):  # 3 warm-up steps: torch's PowerSGD compresses from its third
            for name in names[i % len(names) :] + names[: i % len(names)]:
                elapsed = step(name)
                if i >= 3:
                    times[name].append(elapsed)
        for reducer in reducers.values():
            close_reducer(reducer)
        return {name: statistics.median(t) for name, t in times.items()}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def part_c(steps: int, width: int, depth: int, rounds: int, link_sizes: list[int]) -> None:
    from lightning_dp_strategies.plan import Link
    from lightning_dp_strategies.plan.compression import compression_pays

    keys = list(PART_C)
    result = _train_runs(keys, steps, width, depth, rounds)
    world, base = 2, "ring_allreduce+ring"
    base_bytes = result["stats"][base]["bytes_sent"]
    print(
        f"\n(c) reducers, compression and torch's DDP communication hooks in ring_allreduce, against Lightning's ddp; "
        f"2 processes, {result['params'] / 1e6:.1f} M parameters, {rounds} alternating rounds in one launch"
    )
    print(
        "  bytes per step and rank: 'counted' by the strategy; 'payload' = the known wire payload of the method as a\n"
        "  bandwidth-optimal all-reduce (torch's hooks do their own traffic, which the adapter cannot count;\n"
        "  PowerSGD: r(n+m) per compressed n x m matrix plus the rest in fp32; ddp: the fp32 gradients)"
    )
    header = f"  {'reducer':<28} {'MB/step':>8} {'bytes':>8} {'bytes/ring':>10} {'ms/step':>8}"
    print(header + f" {'time/ring':>9} {'IQR':>6} {'time/ddp':>8} {'IQR':>6}")
    measured: dict[str, float] = {}
    rows: list[list[str]] = []
    for key in keys:
        sent = _row_bytes(result, key, world)
        ms, _, ratio, spread = _paired(result, key, base)
        _, _, to_ddp, ddp_spread = _paired(result, key, "ddp")
        measured[key] = ms
        label, source = PART_C[key]
        print(
            f"  {label:<28} {sent / 1e6:8.2f} {source:>8} {sent / base_bytes:10.3f} {ms * 1e3:8.1f}"
            f" {ratio:9.3f} {spread:6.3f} {to_ddp:8.3f} {ddp_spread:6.3f}"
        )
        rows.append(
            [
                label,
                f"{sent / 1e6:.2f}",
                source,
                f"{sent / base_bytes:.3f}",
                f"{ms * 1e3:.1f}",
                f"{ratio:.3f}",
                f"{spread:.3f}",
                f"{to_ddp:.3f}",
                f"{ddp_spread:.3f}",
            ]
        )
    notes = []
    for name, baseline in (("hook:powersgd", "ring_allreduce+powersgd_native"), ("hook:fp16", "ring_allreduce+fp16")):
        _, ratios, ratio, spread = _paired(result, baseline, name)
        line = (
            f"{PART_C[baseline][0]} / {PART_C[name][0]} = {ratio:.3f} (IQR {spread:.3f}; per round "
            + " ".join(f"{r:.2f}" for r in ratios)
            + ")"
        )
        print("  " + line)
        notes.append(line)
    columns = ["reducer", "MB/step", "bytes", "bytes/ring", "ms/step", "time/ring", "IQR", "time/ddp", "IQR"]
    title = (
        f"(c) Reducers, compression and torch's DDP communication hooks in ring_allreduce, 2 processes, "
        f"{result['params'] / 1e6:.1f} M parameters, {rounds} alternating rounds"
    )
    _record(title, columns, rows, notes)

    links = _fit_loopback(link_sizes, repeats=10)
    compute = _compression_compute(width, depth, steps=8)
    print(
        "\n  cost model (lightning_dp_strategies.plan.compression): plain t0 = B 2(N-1) alpha + 2(N-1)/N G / beta;\n"
        "  compressed t1 = k B 2(N-1) alpha + 2(N-1)/N P / beta + c (c: extra compute, measured at world 1 on the\n"
        "  same buckets, one thread); pays when beta < beta* = 2(N-1)/N (G - P) / (c + (k-1) B 2(N-1) alpha)"
    )
    link_notes = []
    for name, link in links.items():
        line = (
            f"loopback link fitted on {name} all-reduces of "
            + ", ".join(_size(n) for n in link_sizes)
            + f" at 2 ranks: latency {link.latency_s * 1e6:.0f} us/step, bandwidth"
            f" {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s ({link.bandwidth_bytes_per_s * 8 / 1e9:.1f} Gbit/s)"
        )
        print("  " + line)
        link_notes.append(line)
    verdicts: list[list[str]] = []
    print(
        f"  {'compression':<28} {'k':>2} {'c ms':>6} {'beta* Gbit/s':>12} {'t0 ms':>7} {'t1 ms':>7} {'verdict':>8}"
        f" {'pred ratio':>10} {'measured':>8}"
    )
    shapes = result["shapes"]
    for key, (method, rounds_per_bucket, baseline) in COMPRESSED.items():
        extra = max(0.0, compute[key] - compute[baseline])
        link = links["gloo" if key.startswith("hook:") or "native" in key else "ring"]
        verdict = compression_pays(shapes, world, link, method, extra, rounds=rounds_per_bucket, rank=4)
        predicted = (measured[baseline] - verdict.saved_seconds) / measured[baseline]
        _, _, observed, _ = _paired(result, key, baseline)
        print(
            f"  {PART_C[key][0]:<28} {rounds_per_bucket:2d} {extra * 1e3:6.1f}"
            f" {verdict.break_even_bytes_per_s * 8 / 1e9:12.2f} {verdict.plain_seconds * 1e3:7.1f}"
            f" {verdict.compressed_seconds * 1e3:7.1f} {'pays' if verdict.pays else 'costs':>8}"
            f" {predicted:10.3f} {observed:8.3f}"
        )
        verdicts.append(
            [
                PART_C[key][0],
                str(rounds_per_bucket),
                f"{extra * 1e3:.1f}",
                f"{verdict.break_even_bytes_per_s * 8 / 1e9:.2f}",
                f"{verdict.plain_seconds * 1e3:.1f}",
                f"{verdict.compressed_seconds * 1e3:.1f}",
                "pays" if verdict.pays else "costs",
                f"{predicted:.3f}",
                f"{observed:.3f}",
            ]
        )
    columns = ["compression", "k", "c ms", "beta* Gbit/s", "t0 ms", "t1 ms", "verdict", "predicted ratio", "measured"]
    _record(
        "(c) When compression pays on this loopback link: the cost model against measurement",
        columns,
        verdicts,
        link_notes,
    )
    at_scale: list[list[str]] = []
    print(
        "  (pred ratio: the measured baseline step (ring, native or allreduce_hook) minus the predicted saving, over\n"
        "  that step; measured: the median per-round ratio to the same baseline. No overlap is modelled.)"
    )
    print(
        f"\n  predicted at 8 ranks, latency 10 us/step, the compute measured here (one CPU core; a GPU computes the\n"
        f"  factors far faster), this model's {len(shapes)} gradients; saved ms/step = t0 - t1 (+: compression pays)"
    )
    speeds = (1, 10, 100)
    print(f"  {'compression':<28} " + " ".join(f"{f'{g} Gbit/s':>10}" for g in speeds) + f" {'beta* Gbit/s':>12}")
    for key, (method, rounds_per_bucket, baseline) in COMPRESSED.items():
        extra = max(0.0, compute[key] - compute[baseline])
        cells, beta = [], 0.0
        for gbit in speeds:
            verdict = compression_pays(shapes, 8, Link(1e-5, gbit * 1e9 / 8), method, extra, rounds_per_bucket, 4)
            cells.append(f"{verdict.saved_seconds * 1e3:+10.1f}")
            beta = verdict.break_even_bytes_per_s
        print(f"  {PART_C[key][0]:<28} " + " ".join(cells) + f" {beta * 8 / 1e9:12.2f}")
        at_scale.append([PART_C[key][0], *(c.strip() for c in cells), f"{beta * 8 / 1e9:.2f}"])
    columns = ["compression", *(f"saved ms at {g} Gbit/s" for g in speeds), "beta* Gbit/s"]
    _record(
        "(c) Predicted at 8 ranks, latency 10 us/step, with the compute measured here (one CPU core)", columns, at_scale
    )


REPORT: Report | None = None
"""Where the parts record their tables when ``--json`` is given."""


def _record(title: str, columns: list[str], rows: list[list[str]], notes: list[str] | None = None) -> None:
    if REPORT is not None:
        REPORT.table(title, columns, rows, notes)


def main() -> None:
    global REPORT
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["a", "b", "c", "both", "all"], default="both", help="both: a and b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40, help="(a): interleaved rounds per size and launch, at most")
    parser.add_argument("--launches", type=int, default=5, help="(a): fresh process pairs; the ratio is their median")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[n // 1024 for n in SIZES], help="(a) sizes")
    parser.add_argument("--steps", type=int, default=15, help="Trainer steps per fit; the first third is warm-up")
    parser.add_argument("--width", type=int, default=1536, help="MLP width (default: ~21 M parameters at depth 9)")
    parser.add_argument("--depth", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=10, help="fits per strategy, alternating in one launch")
    parser.add_argument(
        "--link-sizes-kib", type=int, nargs="+", default=[256, 4096, 32768], help="(c): sizes the link is fitted on"
    )
    parser.add_argument("--json", type=Path, help="also write the results here (see benchmarks/render_docs.py)")
    args = parser.parse_args()
    REPORT = Report(f"ring_allreduce_{args.part}", vars(args))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    if args.part in ("a", "both"):
        part_a(args.world, args.repeats, args.launches, [kib * 1024 for kib in args.sizes_kib])
    if args.part in ("b", "both"):
        part_b(args.steps, args.width, args.depth, args.rounds)
    if args.part in ("c", "all"):
        part_c(args.steps, args.width, args.depth, args.rounds, [kib * 1024 for kib in args.link_sizes_kib])
    REPORT.save(args.json)


if __name__ == "__main__":
    main()
