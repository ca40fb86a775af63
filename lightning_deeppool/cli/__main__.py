"""``python -m lightning_deeppool.cli``: the ``deeppool`` command."""

from lightning_deeppool.cli import main

main()
