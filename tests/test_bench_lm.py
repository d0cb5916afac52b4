"""The language-model benchmark's pieces on tiny sizes: the corpus, the batches, the model, the link arithmetic.

The benchmark itself needs root and minutes on the simulated cluster (``benchmarks/bench_lm.py``); nothing here
runs it or asserts on speed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_lm  # noqa: E402
import lm_task  # noqa: E402
import netsim  # noqa: E402

TINY = lm_task.LMConfig(d_model=32, layers=1, heads=2, context=16, batch=2, lr=3e-3)


def test_corpus_holds_back_the_last_tenth_of_pydoc_topics() -> None:
    train, val = lm_task.corpus()
    assert train.dtype == torch.uint8 and len(train) > 100_000
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 1e-3
    assert bytes(train[:200].tolist()) != bytes(val[:200].tolist())


def test_each_rank_takes_its_rows_of_the_one_global_batch() -> None:
    train, _ = lm_task.corpus()
    whole = next(iter(lm_task.TrainWindows(train, lm_task.LMConfig(context=16, batch=4), seed=3)))
    parts = [next(iter(lm_task.TrainWindows(train, TINY, rank=r, world=2, seed=3))) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])  # the targets are the next bytes


def test_the_tiny_model_learns_bytes_and_ties_its_head_to_the_embedding() -> None:
    torch.manual_seed(0)
    train, val = lm_task.corpus()
    model = lm_task.ByteLM(TINY)
    assert lm_task.parameter_count(TINY) == sum(p.numel() for p in model.parameters())
    held_out = lm_task.val_batches(val, TINY.context, count=8, batch=4)
    before = lm_task.evaluate(model, held_out)
    assert abs(before - math.log(256)) < 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY.lr)
    batches = iter(lm_task.TrainWindows(train, lm_task.LMConfig(32, 1, 2, 16, 16), seed=0))
    for _ in range(40):
        model.loss(*next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert lm_task.evaluate(model, held_out) < before - 1.0


def test_peak_window_finds_the_burst_in_a_sampled_counter() -> None:
    times = [0.05 * i for i in range(200)]  # 10 s sampled every 50 ms: 1 MB/s, and 8 MB more between 4.0 and 4.5 s
    counts = [1e6 * t + 8e6 * min(1.0, max(0.0, (t - 4.0) / 0.5)) for t in times]
    assert netsim.peak_window(times, counts, 1.0) == pytest.approx(9e6, rel=0.01)
    assert netsim.peak_window(times, counts, 0.25) == pytest.approx(4.25e6, rel=0.02)
    assert netsim.peak_window([0.0], [5.0]) == 0.0


def test_counters_parse_and_training_traffic_leaves_out_pauses() -> None:
    assert netsim.parse_counters("1.0 5 6 7 8\n1.1 9 10\n") == [(1.0, [5, 7], [6, 8])]
    # node 0 sends 1 MB every 0.1 s; 50 MB more during a pause (an evaluation) between wall times 2 and 3
    samples = [(0.1 * i, [int(1e6 * i + (50e6 if i > 25 else 0)), 0], [0, 0]) for i in range(51)]
    moved = bench_lm.traffic(samples, [[0.0, 2.0], [3.0, 5.0]], nodes=2)
    assert moved["sent_bytes"][0] == pytest.approx(40e6, rel=0.03)
    assert moved["peak_bytes_1s"][0] == pytest.approx(10e6, rel=0.15)
    assert moved["sent_bytes"][1] == 0


def test_dry_run_prints_the_plan_and_names_every_variant_once() -> None:
    assert len(set(bench_lm.VARIANTS)) == len(bench_lm.VARIANTS)
    assert all(v.startswith(("ddp", "ring", "powersgd", "local", "diloco", "streaming")) for v in bench_lm.VARIANTS)
    out = run_script([str(BENCHMARKS / "bench_lm.py"), "--dry-run", "--links", "200mbit", "--nodes", "2"], 120)
    assert out.startswith("200mbit x 2 nodes: ddp, ring_allreduce,"), out


def test_time_to_target_interpolates_between_evaluations_and_says_when_never() -> None:
    points = [{"seconds": 0.0, "val_loss": 5.0}, {"seconds": 10.0, "val_loss": 4.0}, {"seconds": 20.0, "val_loss": 2.0}]
    assert bench_lm.crossing(points, 3.0) == pytest.approx(15.0)
    assert bench_lm.crossing(points, 1.0) is None


def test_a_run_without_ddp_is_summarised_with_no_target_and_blank_ratios() -> None:
    """A stored cell's runs with ddp left out (``--variants`` without it): no target loss, the time to ddp's loss and
    the ratio stay blank in the table and the note says why, instead of failing on the missing target."""
    stored = json.loads((Path(bench_lm.__file__).parent / "results" / "lm.json").read_text())["cells"][0]
    runs = {name: run for name, run in stored["runs"].items() if name != "ddp"}
    cell = {**stored, "runs": runs, **bench_lm.summarize(runs)}
    assert cell["target_loss"] is None and all(row["ratio_to_ddp"] is None for row in cell["variants"].values())
    rows = bench_lm.table([cell])
    assert rows and all(row[6] == "-" and row[7] == "-" for row in rows)
    assert "ddp not run" in bench_lm.cell_note(cell)


def test_the_learning_rate_warms_up_linearly_then_holds() -> None:
    """The module's AdamW starts at ``lr / warmup`` and reaches ``lr`` after ``warmup`` optimizer steps; with
    ``warmup=0`` it starts at ``lr``."""
    config = lm_task.LMConfig(32, 1, 2, 16, 2, lr=1e-3, warmup=4)
    settings = lm_task.lightning_module(config).configure_optimizers()
    optimizer, schedule = settings["optimizer"], settings["lr_scheduler"]["scheduler"]
    assert settings["lr_scheduler"]["interval"] == "step"
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    plain = lm_task.lightning_module(lm_task.LMConfig(32, 1, 2, 16, 2, lr=1e-3, warmup=0)).configure_optimizers()
    assert plain["optimizer"].param_groups[0]["lr"] == pytest.approx(1e-3)


def test_add_to_refuses_cells_trained_otherwise_and_records_every_stored_cell(tmp_path: Path) -> None:
    """``--add-to`` keeps the stored cells only when they trained with the same settings (else it names the setting
    that differs before measuring anything), and the merged result's settings name every cell's link and node
    count, not only the last invocation's."""
    stored = json.loads((BENCHMARKS / "results" / "lm.json").read_text())
    args = bench_lm.arguments().parse_args(["--links", "200mbit", "--nodes", "2"])
    training = {k: getattr(args, k) for k in bench_lm.TRAINING}
    with pytest.raises(SystemExit, match="warmup: stored 5, now 20"):
        bench_lm.check_same_training({**training, "warmup": 5}, training, tmp_path / "lm.json")
    bench_lm.check_same_training(dict(training), training, tmp_path / "lm.json")

    stored["settings"].update(training)
    (tmp_path / "lm.json").write_text(json.dumps(stored))
    new = next(c for c in stored["cells"] if (c["link"], c["nodes"]) == ("200mbit", 2))
    args.add_to, args.json, args.figure = tmp_path / "lm.json", tmp_path / "out.json", tmp_path / "lm.png"
    bench_lm.save([new], args, [], None)
    merged = json.loads((tmp_path / "out.json").read_text())
    assert sorted(merged["settings"]["links"]) == ["1gbit", "200mbit"] and merged["settings"]["nodes"] == [2, 4]
    assert len(merged["cells"]) == len(stored["cells"])


def test_the_quoted_sentence_says_when_streaming_never_reached_ddps_loss() -> None:
    """A cell where ``streaming_diloco`` did not reach ddp's final loss says so in words, not as a share."""
    stored = json.loads((BENCHMARKS / "results" / "lm.json").read_text())
    cell = next(c for c in stored["cells"] if (c["link"], c["nodes"]) == ("200mbit", 2))
    reached = bench_lm.streaming_clause(cell)
    assert "reached ddp's final held-out loss in 0." in reached
    cell["variants"]["streaming_diloco"] = {**cell["variants"]["streaming_diloco"], "ratio_to_ddp": None}
    never = bench_lm.streaming_clause(cell)
    assert "did not reach ddp's final held-out loss within its budget" in never and "not reached of" not in never


def test_steps_benchmark_takes_each_seeds_target_from_ddp_and_counts_every_variants_first_step_below_it() -> None:
    """``bench_lm_steps.py``: a seed's target is ddp's loss at the target step; ddp's own first step at or below it
    can come earlier (a bump); a variant that never gets there is shown as more than the steps trained, and the mean
    is left out then."""
    import bench_lm_steps

    curve = [[36, 2.70], [37, 2.60], [38, 2.62], [39, 2.61], [40, 2.58]]
    runs = {
        0: {"ddp": {"points": curve}, "slow": {"points": [[39, 2.7], [40, 2.605]]}},
        1: {"ddp": {"points": [[39, 3.0]]}, "slow": {"points": [[39, 3.1], [40, 3.05]]}},
    }
    seeds = bench_lm_steps.summarize(runs, target_step=39)
    assert seeds[0] == {"target_loss": 2.61, "steps_to_target": {"ddp": 37, "slow": 40}}
    assert seeds[1]["steps_to_target"] == {"ddp": 39, "slow": None}
    rows = bench_lm_steps.table(seeds, ["ddp", "slow"], limit=40)
    assert rows == [["ddp", "37", "39", "38.0"], ["slow", "40", "> 40", "> 40 in some seed"]]


def test_steps_benchmark_builds_every_variant_and_its_dry_run_names_them_per_seed() -> None:
    import bench_lm_steps

    for line in bench_lm_steps.VARIANTS.values():
        strategy = bench_lm.strategy_from(line)
        assert strategy is not None
        make_outer = getattr(getattr(strategy, "local_config", None), "outer_optimizer", None)
        if make_outer is not None:  # a factory in the line runs (a lambda sees the names it was evaluated over)
            assert isinstance(make_outer([torch.zeros(2, requires_grad=True)]), torch.optim.Optimizer)
    out = run_script([str(BENCHMARKS / "bench_lm_steps.py"), "--dry-run", "--seeds", "3"], 120)
    expected = [f"seed 3: {v:22s} {bench_lm_steps.VARIANTS[v]}" for v in bench_lm_steps.DEFAULT_VARIANTS]
    assert out.splitlines() == expected


def test_steps_benchmark_quotes_every_variants_steps_seed_by_seed() -> None:
    import bench_lm_steps

    seeds = {
        0: {"target_loss": 2.6, "steps_to_target": {"ddp": 37, "streaming_diloco": 42}},
        1: {"target_loss": 2.7, "steps_to_target": {"ddp": 39, "streaming_diloco": None}},
    }
    assert bench_lm_steps.quote(seeds, 39) == (
        "Over seeds 0, 1, the steps to ddp's loss after 39 steps were: ddp itself a mean of 38.0 (37, 39); "
        "`streaming_diloco` no mean (a seed fell short) (42, not within the run)."
    )


def test_a_seed_reaches_the_workers_and_a_result_stored_before_seeds_counts_as_seed_0(tmp_path: Path) -> None:
    """``--seed`` goes on every worker's command line; ``--add-to`` takes a stored result without a seed as trained
    from seed 0 (the seed it always used) and refuses another seed."""
    import _launch

    args = bench_lm.arguments().parse_args(["--seed", "3"])
    command = _launch.worker_command(bench_lm.__file__, "ddp", tmp_path / "out.json", args, bench_lm.WORKER_SETTINGS)
    assert command[command.index("--seed") + 1] == "3"
    training = {k: getattr(args, k) for k in bench_lm.TRAINING}
    before = {k: v for k, v in training.items() if k != "seed"}
    bench_lm.check_same_training(before, {**training, "seed": 0}, tmp_path / "lm.json")
    with pytest.raises(SystemExit, match="seed: stored 0, now 3"):
        bench_lm.check_same_training(before, training, tmp_path / "lm.json")


def test_seeds_benchmark_gives_each_seeds_share_of_its_own_ddp_and_their_median() -> None:
    """``bench_lm_seeds.py``: a row per seed and run, each share against the seed's own ddp run, the median counting
    a seed that fell short as the longest; its runs use ``bench_lm.py``'s settings with the seed and budget given."""
    import bench_lm_seeds

    stored = json.loads((BENCHMARKS / "results" / "lm.json").read_text())
    cell = next(c for c in stored["cells"] if (c["link"], c["nodes"]) == ("200mbit", 2))
    runs = {v: cell["runs"][v] for v in ("ddp", "streaming_diloco")}
    first = {**cell, "runs": runs, **bench_lm.summarize(runs), "seed": 0}
    slow = json.loads(json.dumps(first))
    slow["seed"], slow["variants"]["streaming_diloco"]["ratio_to_ddp"] = 1, 0.5
    never = json.loads(json.dumps(first))
    never["seed"], never["variants"]["streaming_diloco"]["ratio_to_ddp"] = 2, None
    share = first["variants"]["streaming_diloco"]["ratio_to_ddp"]
    assert 0 < share < 0.5
    rows = bench_lm_seeds.table([first, slow, never])
    assert [row[:2] for row in rows] == [[s, v] for s in (0, 1, 2) for v in ("ddp", "streaming_diloco")]
    assert rows[1][6] == f"{share:.2f}" and rows[5][6] == "-"  # the "/ ddp" column
    said = bench_lm_seeds.quote([first, slow, never], ["streaming_diloco"])
    step = first["variants"]["streaming_diloco"]["seconds_per_step"] / first["variants"]["ddp"]["seconds_per_step"]
    assert f"in {share:.2f}, 0.50, not reached of ddp's time (median 0.50), a step taking {step:.2f} to" in said, said
    assert "no median" in bench_lm_seeds.quote([first, never, never], ["streaming_diloco"])
    # a failed run is named and left out of the median; a seed whose ddp run failed has no share to give
    failed = json.loads(json.dumps(first))
    failed["seed"], failed["runs"] = 3, {"ddp": first["runs"]["ddp"]}
    failed.update(bench_lm.summarize(failed["runs"]))
    alone = json.loads(json.dumps(first))
    alone["seed"], alone["runs"] = 4, {"streaming_diloco": first["runs"]["streaming_diloco"]}
    alone.update(bench_lm.summarize(alone["runs"]))
    said = bench_lm_seeds.quote([first, slow, failed, alone], ["streaming_diloco"])
    assert f"in {share:.2f}, 0.50, failed, no ddp run of ddp's time (median {(share + 0.5) / 2:.2f})" in said, said
    assert bench_lm_seeds.table([alone])[0][5:7] == ["-", "-"]  # no target: no time to it, no share
    args = bench_lm_seeds.arguments().parse_args(["--seeds", "4", "--budget", "30"])
    lm = bench_lm_seeds.training(args, 4)
    assert (lm.seed, lm.budget, lm.d_model, lm.lr) == (4, 30.0, 384, 1e-3)
    assert bench_lm_seeds.plan(args) == ["seed 4: 200mbit x 2 nodes: ddp, streaming_diloco (30 s of training each)"]
