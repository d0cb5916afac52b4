"""Stage placement: cut the body into balanced chunks, give each rank its blocks, and the whole model back to rank 0."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_dp_strategies.pipeline import balance_by_parameters, balance_by_time, check_balance
from lightning_dp_strategies.pipeline.activations import Activation, check_blocks, is_activation
from lightning_dp_strategies.pipeline.layout import Layout, StageBody, prefix_of
from lightning_dp_strategies.pipeline.materialize import check_initializable, has_meta, materialize
from lightning_dp_strategies.pipeline.placement import release, return_to_rank_zero, share_units
from lightning_dp_strategies.pipeline.schedule import chunk_ranks
from lightning_dp_strategies.strategies.hybrid_pipeline.config import HybridPipelineConfig

__all__ = ["StagePlacement"]


def _body(module: nn.Module, layout: Layout) -> nn.Sequential:
    """The real body, also while a stand-in shadows it for attribute access."""
    body = module._modules[layout.body_name]
    assert isinstance(body, nn.Sequential)
    return body


class StagePlacement:
    """Where the blocks of the body live: partition, placement, replica sync, and the return to rank 0.

    Args:
        config: the strategy's options (stages, chunks per rank, schedule, balance).

    Attributes:
        whole_on_rank_zero: rank 0 held the whole model at the last placement: it gets it back at teardown (kept
            after teardown, for a checkpoint saved after ``fit``).
        blocks_checked: the blocks' outputs were checked in this run (see :meth:`check_blocks`).

    Examples:
        >>> placement = StagePlacement(HybridPipelineConfig(pipeline_stages=2))
        >>> placement.whole_on_rank_zero, placement.blocks_checked
        (False, False)
    """

    def __init__(self, config: HybridPipelineConfig) -> None:
        self.config = config
        self.whole_on_rank_zero = False
        self.blocks_checked = False

    # ------------------------------------------------------------------ partition
    def partition(
        self, module: pl.LightningModule, body_name: str, mesh: Any, rank: int, world: int
    ) -> tuple[Layout, list[StageBody]]:
        """Work out the balance and gather this stage's blocks into :class:`StageBody` chunks of its own.

        The module, and its ``nn.Sequential`` body, stay as they are: the blocks are shared, not moved.

        Args:
            module: the LightningModule, opted in.
            body_name: the attribute holding the body.
            mesh: the ``("pipeline", "data_parallel")`` device mesh.
            rank: this rank's global rank.
            world: the world size.

        Returns:
            This rank's layout and the chunks of blocks its runner runs.
        """
        body = getattr(module, body_name)
        blocks = list(body)
        config = self.config
        chunks = config.chunks
        if config.chunks_per_rank > 1 and 0 < len(blocks) < chunks:
            raise ValueError(
                f"schedule={config.schedule!r} cuts the body into pipeline_stages x virtual_stages = "
                f"{config.pipeline_stages} x {config.chunks_per_rank} = {chunks} chunks, but it has {len(blocks)} "
                f"blocks. Split the body into at least {chunks} blocks, lower virtual_stages (or pipeline_stages), or "
                "use schedule='1f1b'."
            )
        if isinstance(config.balance, tuple):
            balance = check_balance(config.balance, len(blocks), chunks)
        elif config.balance == "time":
            balance = self._balance_by_time(module, blocks, rank, world)
        else:
            balance = balance_by_parameters(blocks, chunks)
        replicas = max(1, world // config.pipeline_stages)
        layout = Layout(
            stage=rank // replicas,
            replica=rank % replicas,
            replicas=replicas,
            pipeline_group=mesh.get_group("pipeline"),
            data_group=mesh.get_group("data_parallel"),
            body_name=body_name,
            balance=balance,
            full_keys=list(module.state_dict().keys()),
            param_order=[n for n, _ in module.named_parameters()],
            body_prefix=prefix_of(module, body),
            chunk_ranks=chunk_ranks(config.schedule, config.pipeline_stages, config.chunks_per_rank),
        )
        check_not_shared_across_stages(blocks, layout)
        bodies = [StageBody({i: blocks[i] for i in layout.chunk_blocks(c)}) for c in layout.chunks]
        return layout, bodies

    def _balance_by_time(self, module: pl.LightningModule, blocks: list[nn.Module], rank: int, world: int) -> list[int]:
        """Rank 0 measures the blocks and every rank uses its balance (timings differ per process); rank 0's
        refusal is raised on every rank."""
        box: list[Any] = [None]
        if rank == 0:
            sample = getattr(module, "example_input_array", None)
            if any(has_meta(block) for block in blocks):
                box[0] = (
                    "balance='time' measures each block, but rank 0 holds the body on the meta device (deferred "
                    "initialization, or it was built eagerly on another rank only). Use balance='parameters' "
                    "(computed from the shapes) or an explicit list."
                )
            elif not is_activation(sample):
                box[0] = (
                    "balance='time' measures each block on `example_input_array`, which "
                    f"{type(module).__name__} does not set to a tensor or a tuple of tensors. Set "
                    "`self.example_input_array = torch.randn(batch, ...)` in __init__, or use balance='parameters' or "
                    "an explicit list."
                )
            else:
                box[0] = balance_by_time(blocks, sample, self.config.chunks)
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise ValueError(box[0])
        return list(box[0])

    def check_blocks(self, module: nn.Module | None, layout: Layout | None, inputs: Activation, source: str) -> None:
        """Once per run, check on fake tensors what each block of the body returns for ``inputs`` (every rank alike).

        Args:
            module: the LightningModule (nothing is checked without it or ``layout``).
            layout: this rank's layout.
            inputs: the body's input.
            source: what ``inputs`` are, for the error message.
        """
        if self.blocks_checked or module is None or layout is None:
            return
        check_blocks(list(_body(module, layout)), inputs, source)
        self.blocks_checked = True

    # ------------------------------------------------------------------ placement
    def place(
        self,
        module: pl.LightningModule,
        layout: Layout,
        seat: tuple[int, int],
        devices: tuple[torch.device, torch.device],
        keep_others: bool = False,
    ) -> None:
        """Give this rank the blocks of its stage and every submodule outside the body, and release the other blocks.

        A block no rank holds (built on the meta device: deferred init) is allocated and initialized by the ranks
        that need it, block ``i`` under the seed ``rank 0's torch.initial_seed() + i`` (submodules outside the body
        under ``+ len(body) + k``), so the values do not depend on the number of stages. A block another rank holds
        (after an earlier run each rank holds only its stage) is received from rank 0, or else from the rank that
        holds it. The other stages' blocks are moved to the meta device (kept with ``keep_others``, which is for
        ``BaseFinetuning``: it compares parameters by value, which a meta tensor cannot; a meta body is refused then).

        Args:
            module: the LightningModule.
            layout: this rank's layout.
            seat: this rank's global rank and the world size.
            devices: this rank's device, and the one point-to-point tensors travel on.
            keep_others: keep the other stages' blocks (until teardown).
        """
        body = _body(module, layout)
        outside = [child for name, child in module.named_children() if name != layout.body_name]
        units: list[nn.Module] = [*body, *outside]
        rank, world = seat
        replicas = layout.replicas
        ranges = [range(s * replicas, (s + 1) * replicas) for s in range(layout.stages)]
        owners = [set(ranges[layout.block_stage(i)]) for i in range(len(body))]
        needed_by = [*owners, *[set(range(world)) for _ in outside]]  # every stage runs training_step's replay
        _check_own_tensors(module)
        if world == 1:
            nowhere = [i for i, unit in enumerate(units) if has_meta(unit)]
            self.whole_on_rank_zero = not nowhere
        else:
            shared = share_units(units, needed_by, *devices)
            self.whole_on_rank_zero, nowhere = shared.whole_on_rank_zero, shared.nowhere
        if keep_others and nowhere:
            raise ValueError(
                "A BaseFinetuning callback compares parameters by value (`torch.equal`), which the blocks of other "
                f"stages, on the meta device, cannot do; {type(module).__name__} builds its body on the meta device. "
                "Build the body eagerly in __init__ (each rank then keeps every block while fitting), or unfreeze in "
                "the LightningModule's own hooks (`requires_grad_` on the blocks, a new group with `add_param_group`)."
            )
        # checked on every rank over every block, so that a block no stage can initialize fails on all of them
        check_initializable([(i, units[i]) for i in nowhere])
        if nowhere:
            box = [torch.initial_seed() % 2**31]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            mine = [(i, units[i]) for i in nowhere if rank in needed_by[i]]
            materialize(mine, devices[0], seed=int(box[0]))
        if not keep_others:
            release([block for i, block in enumerate(body) if i not in layout.local_blocks])

    @staticmethod
    def sync_replicas(module: nn.Module, layout: Layout) -> None:
        """Every replica of a stage starts from replica 0's parameters and buffers (as DDP does from rank 0).

        Args:
            module: the LightningModule, placed.
            layout: this rank's layout.
        """
        if layout.replicas == 1:
            return
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if layout.owns(name):
                dist.broadcast(tensor.data, group=layout.data_group, group_src=0)

    # ------------------------------------------------------------------ teardown
    def return_to_rank_zero(
        self, module: nn.Module, layout: Layout, rank: int, devices: tuple[torch.device, torch.device], failed: bool
    ) -> None:
        """After a run, rank 0 receives what the other stages hold (their blocks, and the state outside the body that
        the last stage owns) if it held the whole model at setup; the other ranks keep their own stage.

        Args:
            module: the LightningModule.
            layout: this run's layout.
            rank: this rank's global rank.
            devices: this rank's device, and the one point-to-point tensors travel on.
            failed: the run failed (nothing is exchanged then).
        """
        whole = self.whole_on_rank_zero and not failed and dist.is_initialized()
        if whole and self.config.pipeline_stages > 1:
            body = _body(module, layout)
            last = layout.last_stage * layout.replicas
            outside = [child for name, child in module.named_children() if name != layout.body_name]
            direct = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            units: list[Any] = [*body, *outside, direct]
            owners = [layout.block_stage(i) * layout.replicas for i in range(len(body))]
            owners += [last] * (len(outside) + 1)
            return_to_rank_zero(units, owners, *devices)
        if rank != 0:  # blocks kept for BaseFinetuning: the other stages trained them, these are stale
            body = _body(module, layout)
            release([block for i, block in enumerate(body) if i not in layout.local_blocks])


def _check_own_tensors(module: nn.Module) -> None:
    """Refuse tensors the module holds directly on the meta device: no ``reset_parameters()`` can initialize them."""
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    stray = [n for n, t in own if t.is_meta]
    if stray:
        raise TypeError(
            f"{type(module).__name__} holds tensors of its own ({', '.join(stray)}) on the meta device, outside "
            "any submodule, where no `reset_parameters()` can initialize them. Build them on a real device, or "
            "move them into a submodule."
        )


def check_not_shared_across_stages(blocks: list[nn.Module], layout: Layout) -> None:
    """Refuse a parameter or buffer that blocks of different stages share (tied weights, such as an embedding and
    the output layer that reuses its matrix): each stage would hold, train and save a copy of its own.

    Examples:
        >>> from types import SimpleNamespace
        >>> emb, head = nn.Embedding(5, 2), nn.Linear(2, 5, bias=False)
        >>> head.weight = emb.weight
        >>> layout = SimpleNamespace(block_stage=lambda i: 0 if i == 0 else 1, body_prefix="body.")
        >>> check_not_shared_across_stages([emb, nn.Linear(2, 2), head], layout)
        Traceback (most recent call last):
        ...
        ValueError: `body.0.weight` and `body.2.weight` are one tensor (tied weights), and the pipeline puts block 0 ...
    """
    seen: dict[int, tuple[int, str]] = {}
    for index, block in enumerate(blocks):
        tensors = [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
        for name, tensor in tensors:
            first = seen.setdefault(id(tensor), (index, name))
            if layout.block_stage(first[0]) != layout.block_stage(index):
                raise ValueError(
                    f"`{layout.body_prefix}{first[0]}.{first[1]}` and `{layout.body_prefix}{index}.{name}` are one "
                    f"tensor (tied weights), and the pipeline puts block {first[0]} on stage "
                    f"{layout.block_stage(first[0])} and block {index} on stage {layout.block_stage(index)}: each "
                    "stage would train a copy of its own with part of its gradient. Untie them (give each block its "
                    "own parameter), or train with strategy='ring_allreduce', or with pipeline_stages=1."
                )
