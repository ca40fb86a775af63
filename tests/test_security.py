"""Only this job's ranks join its local links: a process of another user that connects to the job's
sockets as they appear, claiming a rank, is refused, and the job trains as on one device. Files
deeppool keeps for itself are this user's only, and read back only if no other user could write them."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pwd
import socket
import stat
import struct
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_deeppool import BackgroundJob, DeepPoolStrategy
from lightning_deeppool.background.job import run_standalone
from lightning_deeppool.comm.admission import Card, accept_peers, link_to, listen
from lightning_deeppool.ir.profile import CommProfile, LayerProfile, Profile
from lightning_deeppool.profiling.cache import load_cached_profile, save_cached_profile

from distributed import run_distributed
from models import (
    images,
    join_lightning_world,
    make_model,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

TOLERANCE = 1e-5
TRAINER = {"max_steps": 3, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
GLOBAL_BATCH = 16


def _nobody() -> pwd.struct_passwd | None:
    """The `nobody` account where this test may become it (it runs as root), else None."""
    try:
        account = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return account if os.geteuid() == 0 and account.pw_uid != 0 else None


NOBODY = _nobody()
as_root = pytest.mark.skipif(NOBODY is None, reason="needs root, to run an intruder as `nobody`")


def _become(uid: int, gid: int) -> None:
    """Run as user `uid` of group `gid` from now on (this process)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _intrude(uid: int, gid: int, stop: Event, found: Connection) -> None:
    """As user `uid`: connect to every deeppool socket listed in /proc/net/unix as soon as it appears,
    once claiming rank 1 (with a made-up secret) and once saying nothing; report the sockets reached."""
    _become(uid, gid)
    seen: set[str] = set()
    reached: list[str] = []
    held: list[socket.socket] = []  # open until the end, as a silent claim would be
    while not stop.is_set():
        with open("/proc/net/unix") as table:
            names = {line.split()[-1] for line in table if "@lightning-deeppool-" in line}
        for name in sorted(names - seen):
            seen.add(name)
            for claim in (struct.pack("<q", 1) + os.urandom(32), b""):
                intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                intruder.settimeout(0.1)
                try:
                    intruder.connect("\0" + name[1:])
                    intruder.sendall(claim)
                except OSError:
                    continue
                held.append(intruder)
                reached.append(name)
        time.sleep(0.0005)
    found.send(sorted(set(reached)))


def _listener_and_peer() -> tuple[socket.socket, Card, Card]:
    """Rank 0's listener and card, and a card for rank 1 in this same process (this user, this pid)."""
    listener, card = listen(0, 4)
    other, peer = listen(1, 4)
    other.close()
    return listener, card, peer


def test_a_wrong_secret_from_the_right_user_and_process_is_refused_and_the_rank_still_links(caplog) -> None:
    listener, card, peer = _listener_and_peer()
    forged = link_to(card, Card(1, peer.pid, peer.address, bytes(32)), timeout_s=5)
    real = link_to(card, peer, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="lightning_deeppool"):
        linked = accept_peers(listener, [peer], timeout_s=5)
    assert list(linked) == [1]
    real.sendall(b"real")
    assert linked[1].recv(4) == b"real"
    assert forged.recv(1) == b""  # closed by the listener
    assert [r.getMessage() for r in caplog.records] == [
        f"deeppool: refused a connection to this rank's link from pid {os.getpid()} (uid {os.geteuid()}), "
        "which is not a rank of this job; waiting for the ranks (further refusals are not logged)"
    ]


def _claim_as(uid: int, gid: int, card: Card, peer: Card, connected: Event, done: Event) -> None:
    """As user `uid`: introduce itself to `card`'s listener as `peer`, its right secret included."""
    _become(uid, gid)
    link = link_to(card, peer, timeout_s=5)
    connected.set()
    done.wait(10)
    link.close()


@as_root
def test_another_user_is_refused_even_with_the_rank_s_secret_and_the_wait_ends_naming_the_rank() -> None:
    assert NOBODY is not None
    listener, card, peer = _listener_and_peer()
    context = mp.get_context("fork")
    connected, done = context.Event(), context.Event()
    intruder = context.Process(
        target=_claim_as, args=(NOBODY.pw_uid, NOBODY.pw_gid, card, peer, connected, done)
    )
    intruder.start()
    try:
        assert connected.wait(10)
        with pytest.raises(TimeoutError) as refused:
            accept_peers(listener, [peer], timeout_s=2)
    finally:
        done.set()
        intruder.join(10)
    assert str(refused.value) == (
        "ranks [1] did not link to this rank within 2 s; connections refused from other processes: 1"
    )


class _Kept(logging.Handler):
    """Keeps the messages it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit(rank: int, init: dict[str, Any], root: str) -> dict[str, Any]:
    join_lightning_world(rank, 2)
    kept = _Kept()
    logging.getLogger("lightning_deeppool").addHandler(kept)
    model = make_model("mlp")
    model.load_state_dict(init)
    strategy = DeepPoolStrategy(plan={"": 2, "head": 1}, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(**trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, **TRAINER))
    trainer.fit(model, DataLoader(images(4 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // 2))
    return {"params": parameters(model), "steps": trainer.global_step, "log": kept.messages}


@pytest.mark.slow
@as_root
def test_another_user_claiming_a_rank_during_setup_neither_breaks_nor_joins_mixed_width_training(
    tmp_path,
) -> None:
    assert NOBODY is not None
    reference = make_model("mlp")
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_fit(reference, images(4 * GLOBAL_BATCH), GLOBAL_BATCH, **TRAINER)
    context = mp.get_context("fork")
    stop = context.Event()
    found, report = context.Pipe(duplex=False)
    intruder = context.Process(target=_intrude, args=(NOBODY.pw_uid, NOBODY.pw_gid, stop, report))
    intruder.start()
    try:
        ranks = run_distributed(_fit, 2, init, str(tmp_path))
    finally:
        stop.set()
        reached = found.recv() if found.poll(10) else None
        intruder.join(10)
    assert reached, "the intruder reached none of the job's sockets: nothing was tested"
    refusals = [m for m in ranks[0]["log"] if "refused a connection" in m]
    assert len(refusals) >= 1 and f"uid {NOBODY.pw_uid}" in refusals[0]
    assert ranks[0]["steps"] == 3
    assert max_param_diff(parameters(reference), ranks[0]["params"]) < TOLERANCE
    assert max_param_diff(ranks[0]["params"], ranks[1]["params"]) == 0


PROFILE = Profile("abc123", "cpu", "float32", {"fc": LayerProfile("fc", (1, 2), (0.5, 0.75))}, CommProfile())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cached_profiles_and_their_folder_are_this_user_s_only(tmp_path) -> None:
    path = save_cached_profile(tmp_path / "cache", "k", PROFILE)
    assert (_mode(tmp_path / "cache"), _mode(path)) == (0o700, 0o600)


def test_a_cached_profile_other_users_may_write_is_ignored_with_a_warning(tmp_path) -> None:
    path = save_cached_profile(tmp_path, "k", PROFILE)
    path.chmod(0o666)
    with pytest.warns(UserWarning, match=r"k.json is owned by uid \d+ with mode -rw-rw-rw-: only files"):
        assert load_cached_profile(tmp_path, "k") is None


@as_root
def test_a_cached_profile_of_another_user_is_ignored_with_a_warning(tmp_path) -> None:
    assert NOBODY is not None
    path = save_cached_profile(tmp_path, "k", PROFILE)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.warns(UserWarning, match=f"k.json is owned by uid {NOBODY.pw_uid} with mode -rw-------"):
        assert load_cached_profile(tmp_path, "k") is None


def _job(steps: int, folder: Path) -> BackgroundJob:
    loader = DataLoader(images(16), batch_size=8)
    return BackgroundJob(lambda: make_model("mlp"), loader, max_steps=steps, name="t", checkpoint_dir=folder)


def test_background_checkpoints_and_their_folder_are_this_user_s_only(tmp_path) -> None:
    assert run_standalone(_job(2, tmp_path / "background"), torch.device("cpu")).state == "done"
    assert (_mode(tmp_path / "background"), _mode(tmp_path / "background" / "t.ckpt")) == (0o700, 0o600)


@as_root
def test_a_background_checkpoint_of_another_user_is_not_resumed(tmp_path) -> None:
    assert NOBODY is not None
    run_standalone(_job(2, tmp_path), torch.device("cpu"))
    os.chown(tmp_path / "t.ckpt", NOBODY.pw_uid, NOBODY.pw_gid)
    stats = run_standalone(_job(4, tmp_path), torch.device("cpu"))
    assert (stats.state, stats.global_step) == ("failed", 0)
    assert f"t.ckpt is owned by uid {NOBODY.pw_uid} with mode -rw-------: only files" in str(stats.error)
