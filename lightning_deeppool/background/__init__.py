"""Background trainers: smaller training jobs that use the time a burst-parallel foreground leaves idle."""

from lightning_deeppool.background.callback import BackgroundTrainers, assign_jobs
from lightning_deeppool.background.job import BackgroundJob, JobStats

__all__ = ["BackgroundJob", "BackgroundTrainers", "JobStats", "assign_jobs"]
