"""Background trainers: smaller training jobs that use the time a burst-parallel foreground leaves idle."""

from lightning_deeppool.background.callback import BackgroundTrainers
from lightning_deeppool.background.job import BackgroundJob, JobStats
from lightning_deeppool.background.placement import assign_jobs

__all__ = ["BackgroundJob", "BackgroundTrainers", "JobStats", "assign_jobs"]
