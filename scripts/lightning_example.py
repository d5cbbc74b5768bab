"""PyTorch Lightning with localckpt: a DDP job saves each epoch to node-local storage, replicated
to another node, and resumes from the newest complete iteration, also after a node was lost.

    torchrun --nproc-per-node 2 scripts/lightning_example.py --root '/dev/shm/ckpt/{node}' \\
        --markers /tmp/markers --epochs 4

The switch from Lightning's default checkpointing is two lines (marked "localckpt"): the plugin
and the strategy that saves on every rank. ``ModelCheckpoint(save_last=True)`` and
``ckpt_path="last"`` resume as with files: the "files" are small markers naming an iteration
(their directory must be one every node sees, as for Lightning's own checkpoints).
``--nodes`` simulates that many nodes on one machine (each its own root, ``{node}`` in
``--root``) so replication has somewhere to go. Rank 0 writes a JSON report (``--report``):
the step it resumed from and a digest of the final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import warnings

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from localckpt import LocalCheckpointManager
from localckpt.integrations.lightning import LocalCkptDDPStrategy, LocalCkptIO


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.resumed_from: int | None = None

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_load_checkpoint(self, checkpoint: dict[str, object]) -> None:
        self.resumed_from = int(checkpoint["global_step"])  # type: ignore[call-overload]


def data() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="node-local root; may contain {node}")
    parser.add_argument("--markers", required=True, help="ModelCheckpoint's directory")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes on this machine")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--report", help="rank 0 writes its JSON report here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def manager() -> LocalCheckpointManager:  # called once the process group exists
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        node = rank * args.nodes // world
        return LocalCheckpointManager(args.root.format(node=node), "lightning-example",
                                      "node_spread" if args.nodes > 1 else None,
                                      node_id=f"node{node}", keep_last=2)

    io = LocalCkptIO(manager_factory=manager, async_save=args.async_save)  # localckpt
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=LocalCkptDDPStrategy() if world > 1 else "auto",  # localckpt
        plugins=[io], max_epochs=args.epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.markers, save_last=True)])
    model = Regression()
    trainer.fit(model, data(), ckpt_path="last")
    if trainer.global_rank == 0 and args.report:
        digest = hashlib.sha256()
        for t in model.state_dict().values():
            digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        with open(args.report, "w") as f:
            json.dump({"resumed_from": model.resumed_from, "global_step": trainer.global_step,
                       "digest": digest.hexdigest()}, f)


if __name__ == "__main__":
    main()
