"""A hand-written Lightning Fabric training loop with ``strategy="deeppool"``, on scikit-learn's digits.

The loop is Fabric's own: ``fabric.setup``, ``setup_dataloaders``, ``backward`` (with gradient
accumulation under ``no_backward_sync``), ``clip_gradients``, an evaluation in ``model.eval()`` and
``torch.no_grad()`` whose accuracy is all-reduced, and ``fabric.save``. Nothing in it is specific to
deeppool but the strategy's name. Runs on 2 CPU processes (or every GPU when there are two or more);
nothing is downloaded.

    python examples/fabric_loop.py                  # launched by fabric.launch()
    python examples/fabric_loop.py --max-steps 5    # smoke test
    fabric run --accelerator cpu --devices 2 examples/fabric_loop.py   # Fabric's CLI launches
    torchrun --nproc-per-node 2 examples/fabric_loop.py                # torchrun launches

The subprocess launcher re-runs this script once per extra device, so everything sits under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import os

import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool  # noqa: F401  (registers strategy="deeppool" for Fabric too)


def digits_net(hidden: int = 2048) -> nn.Module:
    """Convolutions feeding two wide linear layers and a head."""
    return nn.Sequential(
        nn.Conv2d(1, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128 * 16, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out splits (80/20, stratified), pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def evaluate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> float:
    """Held-out accuracy over every rank's share of the data."""
    model.eval()
    correct = torch.zeros((), device=fabric.device)
    seen = torch.zeros((), device=fabric.device)
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(dim=1) == y).sum()
            seen += len(y)
    model.train()
    return float(fabric.all_reduce(correct, reduce_op="sum") / fabric.all_reduce(seen, reduce_op="sum"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per device per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = torch.cuda.device_count() >= 2
    if not cuda:  # every process would otherwise start one thread per core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    fabric = Fabric(
        accelerator="gpu" if cuda else "cpu",
        devices=torch.cuda.device_count() if cuda else 2,
        strategy="deeppool",
    )
    if "LT_CLI_USED" not in os.environ:  # `fabric run` made the processes; torchrun's still call launch()
        fabric.launch()
    fabric.seed_everything(args.seed)

    net = digits_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9))
    train, held_out = digits(args.seed)
    train_loader, test_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(held_out, batch_size=64),
    )

    step = 0
    for epoch in range(args.epochs):
        batches = iter(train_loader)
        while step != args.max_steps:
            micro = [batch for _, batch in zip(range(args.accumulate), batches)]
            if len(micro) < args.accumulate:
                break
            for i, (x, y) in enumerate(micro):
                with fabric.no_backward_sync(model, enabled=i < len(micro) - 1):
                    loss = nn.functional.cross_entropy(model(x), y)
                    fabric.backward(loss / len(micro))
            fabric.clip_gradients(model, optimizer, max_norm=2.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        accuracy = evaluate(fabric, model, test_loader)
        fabric.print(f"epoch {epoch}: {step} steps, held-out accuracy {accuracy:.3f}")
        if step == args.max_steps:
            break

    fabric.save("outputs/fabric_loop/checkpoint.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    fabric.print(f"saved outputs/fabric_loop/checkpoint.ckpt after {step} steps")


if __name__ == "__main__":
    main()
