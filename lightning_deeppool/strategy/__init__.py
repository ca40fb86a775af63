"""The strategy and its burst-parallel runtime."""

from lightning_deeppool.strategy.deeppool import DeepPoolStrategy

__all__ = ["DeepPoolStrategy"]
