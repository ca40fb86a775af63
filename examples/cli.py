"""A LightningCLI program: the strategy, its options and the trainer all come from YAML.

    python examples/cli.py fit --config examples/cli_config.yaml
    python examples/cli.py fit --config examples/cli_config.yaml --trainer.max_steps 3   # smoke test

`cli_config.yaml` selects the strategy with ``class_path: lightning_deeppool.DeepPoolStrategy`` and
sets its options under ``init_args``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from quickstart import DigitsCNN, digits
from torch.utils.data import DataLoader


class DigitsData(pl.LightningDataModule):
    """scikit-learn's handwritten digits (shipped with the package), 80% for training."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        train, _ = digits(self.seed)
        return DataLoader(train, batch_size=self.batch_size, shuffle=True)


if __name__ == "__main__":
    LightningCLI(DigitsCNN, DigitsData)
