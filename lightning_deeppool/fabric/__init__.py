"""The Fabric front door: `DeepPoolStrategy` for training loops written with Lightning Fabric."""

from lightning_deeppool.fabric.strategy import DeepPoolStrategy

__all__ = ["DeepPoolStrategy"]
