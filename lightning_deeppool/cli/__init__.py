"""The ``deeppool`` command (`commands`): plan a model, show a plan, project scaling."""

from lightning_deeppool.cli.commands import main

__all__ = ["main"]
