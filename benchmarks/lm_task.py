"""A real task for the strategies: a byte-level causal Transformer language model on text shipped with Python.

The corpus is the standard library's ``pydoc_data.topics`` (the documentation strings ``help()`` shows), its topics
joined in key order and encoded as UTF-8 bytes: about 0.47 MB on Python 3.11. The last ``val_fraction`` of the bytes
is held out. Training windows are drawn at random offsets of the training bytes by a seeded generator, so every
process and every strategy sees the same global batch sequence for the same seed and global batch; validation scores
a fixed set of windows of the held-out bytes.

The model is a pre-norm GPT: byte embedding (tied to the output head), learned positions, ``layers`` blocks of
causal self-attention and a 4x MLP, a final LayerNorm. It trains with AdamW, the learning rate warmed up linearly
over the first ``warmup`` steps. Only torch is imported at module level (Lightning where the
module is made), so a test can import this file on its own.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

VOCAB = 256


@dataclass(frozen=True)
class LMConfig:
    """The model's shape and the training data's batch."""

    d_model: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 128
    batch: int = 8
    """Sequences per process and step."""
    lr: float = 1e-3
    """AdamW's learning rate (after the warm-up)."""
    warmup: int = 20
    """Optimizer steps over which the learning rate rises linearly from ``lr / warmup`` to ``lr`` (0: none)."""

    @property
    def tokens_per_step(self) -> int:
        """Bytes predicted by one process in one step."""
        return self.batch * self.context


def corpus(val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """``(train, val)``: the bytes of ``pydoc_data.topics`` (topics joined in key order) as ``uint8`` tensors, the last
    ``val_fraction`` held out."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(data) * (1 - val_fraction))
    return data[:split].clone(), data[split:].clone()


def windows(data: Tensor, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-byte targets (``int64``, ``len(starts) x context``) of the windows at ``starts``."""
    index = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = data[index].long()
    return chunk[:, :-1], chunk[:, 1:]


class TrainWindows(torch.utils.data.IterableDataset):
    """An endless stream of this rank's share of each global batch: ``world`` x ``batch`` windows a step, at offsets
    drawn by one generator seeded with ``seed`` (the same on every rank), rank ``r`` taking rows ``r*batch`` on."""

    def __init__(self, data: Tensor, config: LMConfig, rank: int = 0, world: int = 1, seed: int = 0) -> None:
        self.data, self.config, self.rank, self.world, self.seed = data, config, rank, world, seed

    def __iter__(self) -> Any:
        gen = torch.Generator().manual_seed(self.seed)
        high = len(self.data) - self.config.context - 1
        batch = self.config.batch
        while True:
            starts = torch.randint(0, high, (self.world * batch,), generator=gen)
            yield windows(self.data, starts[self.rank * batch : (self.rank + 1) * batch], self.config.context)


def val_batches(data: Tensor, context: int, count: int = 32, batch: int = 16) -> list[tuple[Tensor, Tensor]]:
    """``count`` windows spread evenly over the held-out bytes, in batches of ``batch``."""
    high = len(data) - context - 1
    starts = torch.linspace(0, high, count).long()
    return [windows(data, starts[i : i + batch], context) for i in range(0, count, batch)]


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A byte-level GPT: tied byte embedding and head, learned positions, ``layers`` :class:`Block` s."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.d_model)
        self.pos = nn.Parameter(torch.zeros(config.context, config.d_model))
        self.blocks = nn.ModuleList(Block(config.d_model, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        for name, param in self.blocks.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.norm(h) @ self.embed.weight.T  # the head tied to the embedding

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean next-byte cross-entropy (nats)."""
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def parameter_count(config: LMConfig) -> int:
    """The model's parameters (the tied head counted once)."""
    return sum(p.numel() for p in ByteLM(config).parameters())


def evaluate(model: ByteLM, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy (nats a byte) of ``model`` on ``batches``, without gradients."""
    with torch.no_grad():
        losses = [model.loss(x, y).item() * x.numel() for x, y in batches]
    return sum(losses) / sum(x.numel() for x, _ in batches)


def averaged_state(trainer: Any, module: Any) -> dict[str, Tensor]:
    """The Lightning module's ``state_dict`` as the ranks' mean where they differ (local SGD mid-period, averaged
    exactly in a copy), else its own. Collective under local SGD: every rank calls it."""
    local = getattr(trainer.strategy, "local_sgd", None)
    state: dict[str, Tensor] = module.state_dict()
    return state if local is None else local.averaged_state(state)


def held_out_loss(module: Any, state: dict[str, Tensor], batches: list[tuple[Tensor, Tensor]]) -> float:
    """:func:`evaluate` of a copy of ``module.model`` holding ``state`` (a Lightning module's keys); the module is
    left as it is."""
    model = copy.deepcopy(module.model)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return evaluate(model, batches)


def warmup_factor(step: int, warmup: int) -> float:
    """The share of the learning rate used at optimizer step ``step`` (counted from 0): rising linearly over
    ``warmup`` steps, then 1.

    Examples:
        >>> [warmup_factor(s, 4) for s in range(5)], warmup_factor(0, 0)
        ([0.25, 0.5, 0.75, 1.0, 1.0], 1.0)
    """
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def lightning_module(config: LMConfig) -> Any:
    """A ``LightningModule`` over :class:`ByteLM` (``.model``) that trains with AdamW (lr ``config.lr``, weight decay
    0.1, betas 0.9/0.95), its learning rate warmed up linearly over ``config.warmup`` steps (a ``LambdaLR`` stepped
    every optimizer step), on batches of :class:`TrainWindows`."""
    import lightning as L

    class ByteLMModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = ByteLM(config)

        def training_step(self, batch: tuple[Tensor, Tensor], _: int) -> Tensor:
            return self.model.loss(*batch)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=config.lr, weight_decay=0.1, betas=(0.9, 0.95))
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, config.warmup))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return ByteLMModule()
