"""lightning-deeppool: DeepPool burst parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"deeppool"`` (subprocess launcher, like
``"ddp"``) and ``"deeppool_spawn"`` (spawn launcher, like ``"ddp_spawn"``) for the Trainer and for
Fabric (`lightning_deeppool.fabric.DeepPoolStrategy`).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_deeppool import fabric
from lightning_deeppool.background import BackgroundJob, BackgroundTrainers
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.strategy import DeepPoolStrategy

DeepPoolStrategy.register_strategies(StrategyRegistry)
fabric.DeepPoolStrategy.register_strategies(FABRIC_STRATEGIES)

__all__ = ["BackgroundJob", "BackgroundTrainers", "DeepPoolStrategy", "Plan"]
__version__ = "0.1.0"
