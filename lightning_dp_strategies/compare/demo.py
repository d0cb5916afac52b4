"""The built-in demo: a deterministic synthetic classification task and an MLP LightningModule to train on it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

MODEL_SIZES = {"small": (128, 4), "medium": (512, 6), "large": (1536, 9)}
"""(width, depth) of the demo MLP: about 0.04 M, 1.1 M and 16.6 M parameters."""


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines one comparison run, identical for every strategy in it.

    Examples:
        >>> config = DemoConfig(steps=5, model_size="medium")
        >>> config.steps, config.global_batch, config.model_size
        (5, 64, 'medium')
    """

    steps: int = 30
    global_batch: int = 64
    model_size: str = "medium"
    features: int = 32
    classes: int = 8
    samples: int = 4096
    lr: float = 0.05
    seed: int = 0


def make_dataset(config: DemoConfig, train: bool = True) -> TensorDataset:
    """Gaussian clusters, one per class: learnable, so accuracy means something. Nothing is downloaded.

    Examples:
        >>> config = DemoConfig(samples=256)
        >>> x, y = make_dataset(config).tensors
        >>> tuple(x.shape), tuple(y.shape), len(make_dataset(config, train=False))
        ((256, 32), (256,), 64)
    """
    gen = torch.Generator().manual_seed(config.seed + (0 if train else 1))
    centers = torch.randn(config.classes, config.features, generator=torch.Generator().manual_seed(config.seed))
    n = config.samples if train else config.samples // 4
    y = torch.randint(0, config.classes, (n,), generator=gen)
    x = centers[y] * 1.5 + torch.randn(n, config.features, generator=gen)
    return TensorDataset(x, y)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for each step, this replica's contiguous slice of the step's global batch.

    The global batches (a seeded permutation per epoch, cut into ``global_batch`` samples) are the same whatever the
    number of data-parallel replicas, so every strategy trains on exactly the same data and can be compared with
    the single-device baseline parameter by parameter.

    Examples:
        >>> config = DemoConfig(steps=2, global_batch=8, samples=32)
        >>> whole = list(GlobalBatchSampler(32, config))
        >>> halves = [list(GlobalBatchSampler(32, config, replicas=2, rank=r)) for r in (0, 1)]
        >>> len(whole), len(whole[0]), len(halves[1][0]), all(whole[s] == halves[0][s] + halves[1][s] for s in range(2))
        (2, 8, 4, True)
    """

    def __init__(self, size: int, config: DemoConfig, replicas: int = 1, rank: int = 0) -> None:
        if config.global_batch % replicas:
            raise ValueError(
                f"The global batch ({config.global_batch}) must divide evenly over {replicas} data-parallel replicas;"
                f" pass --global-batch as a multiple of {replicas}."
            )
        self.size, self.config, self.replicas, self.rank = size, config, replicas, rank

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.config.global_batch // self.replicas
        steps_per_epoch = self.size // self.config.global_batch
        for step in range(self.config.steps):
            epoch, k = divmod(step, steps_per_epoch)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.config.seed + epoch))
            start = k * self.config.global_batch + self.rank * per_rank
            yield order[start : start + per_rank].tolist()

    def __len__(self) -> int:
        return self.config.steps


class DemoClassifier(L.LightningModule):
    """An MLP whose body is the ``nn.Sequential`` ``self.blocks``: a sequence of blocks, as pipeline splitting wants.

    Examples:
        >>> model = DemoClassifier(DemoConfig(model_size="small"))
        >>> len(model.blocks), tuple(model(torch.zeros(5, 32)).shape)
        (4, (5, 8))
    """

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        self.config = config
        width, depth = MODEL_SIZES[config.model_size]
        torch.manual_seed(config.seed)
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(config.features, width), nn.ReLU())]
        layers += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 2)]
        layers.append(nn.Linear(width, config.classes))
        self.blocks = nn.Sequential(*layers)

    pipeline_body = "blocks"
    """The opt-in for ``hybrid_pipeline``: the ``nn.Sequential`` to cut into stages (with :meth:`pipeline_loss`)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss of one micro-batch on the last pipeline stage's output (``hybrid_pipeline``'s opt-in)."""
        return self.loss_fn(output, target)

    def loss_fn(self, logits: Tensor, y: Tensor) -> Tensor:
        """The loss on the last block's output (what a pipeline's last stage computes)."""
        return F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.config.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # one process (single device, scatter/gather): the whole global batch; otherwise the strategy's
        # data-parallel replicas (for a pipeline, the replicas only, not the stages)
        single = self.trainer.world_size == 1
        kwargs = {} if single else getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = GlobalBatchSampler(
            self.config.samples, self.config, kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
        )
        return DataLoader(make_dataset(self.config), batch_sampler=sampler)
