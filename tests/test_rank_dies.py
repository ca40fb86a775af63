"""A rank killed in the middle of training stops the others within seconds, naming it: two torchrun
"nodes" of one process each on this machine, so no Lightning parent process watches both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import free_port

SCRIPT = Path(__file__).parent / "scripts" / "rank_dies.py"


def _two_nodes(killed: int, where: str, tmp_path: Path) -> tuple[str, float]:
    """The survivor's output, and how long after the kill it ended."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes, logs = [], []
    for node in range(2):
        log = (tmp_path / f"node{node}.log").open("w")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}"]
        command += ["--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
        nodes.append(
            subprocess.Popen(
                [*command, str(SCRIPT), str(killed), "5", where],
                env=env,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        logs.append(log)
    survivor = nodes[1 - killed]
    survivor.wait(timeout=300)
    ended = time.time()
    nodes[killed].wait(timeout=60)
    for log in logs:
        log.close()
    killed_at = re.search(r"killed at ([0-9.]+)", (tmp_path / f"node{killed}.log").read_text())
    assert killed_at is not None, (tmp_path / f"node{killed}.log").read_text()
    assert survivor.returncode != 0
    return (tmp_path / f"node{1 - killed}.log").read_text(), ended - float(killed_at.group(1))


@pytest.mark.parametrize(("killed", "where"), [(1, "call"), (0, "after")])
def test_a_killed_rank_stops_the_other_within_30_s_naming_it(tmp_path, killed, where):
    output, seconds = _two_nodes(killed, where, tmp_path)
    assert f"rank {killed} closed its link mid-step" in output, output[-3000:]
    assert seconds < 30
