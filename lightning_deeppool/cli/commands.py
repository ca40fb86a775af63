"""The ``deeppool`` command: plan a model, show a plan, project scaling, all without a cluster.

    deeppool plan pkg.module:ClassName --input-shape 3,32,32 --devices 8 --global-batch-size 256
    deeppool show plan.json [--chart plan.png]
    deeppool simulate --profile profile.json --global-batch-size 256 --devices 8,16,32,64

Profiles are measured on this machine; communication uses ``--bandwidth``/``--latency-us`` or the
defaults in `lightning_deeppool.ir.profile` (there is no process group to measure).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import ArgumentParser

from lightning_deeppool.capture import CapturedGraph, CaptureError, capture_graph
from lightning_deeppool.cli.charts import ChartError, plan_chart, simulation_chart
from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import (
    AlphaBeta,
    CommProfile,
    Profile,
)
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import search
from lightning_deeppool.planner.simulate import (
    DEFAULT_BACKGROUND_EFFICIENCY,
    assumptions,
    parse_devices,
    project,
    table,
)
from lightning_deeppool.profiling.layers import (
    candidate_batch_sizes,
    device_name,
    parameter_dtype,
    profile_layers,
    progress_printer,
    time_whole_model,
)


class UsageError(Exception):
    """A problem with the command line or its inputs: reported argparse-style, exit code 2."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except UsageError as err:
        args.subparser.error(str(err))


# ----------------------------------------------------------------------------------- commands
def plan_command(args: argparse.Namespace) -> None:
    """Capture, profile (or load a profile), search, print the table and write the plan."""
    graph, profile = _graph_and_profile(args, world_size=args.devices)
    profile = _with_comm(profile, args)
    pins = _parse_pins(args.pin)
    try:
        plan = search(
            graph,
            profile,
            world_size=args.devices,
            global_batch_size=args.global_batch_size,
            amplification_limit=args.amplification_limit,
            pins=pins,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(plan.table())
    plan.save(args.out)
    print(f"plan written to {args.out}")


def show_command(args: argparse.Namespace) -> None:
    """Print a plan file's table; with --chart, save a chart of width and time per layer."""
    plan = _load(Plan.load, args.plan, "plan")
    print(plan.table())
    if args.chart:
        _draw(plan_chart, plan, args.chart)


def simulate_command(args: argparse.Namespace) -> None:
    """Project DDP, burst and burst + background fill over device counts at a fixed global batch."""
    try:
        devices = parse_devices(args.devices)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.module_path is None and args.profile is None:
        raise UsageError("give a profile (--profile profile.json) or a model (MODULE_PATH --input-shape ...)")
    graph, profile = _graph_and_profile(args, world_size=max(devices))
    profile = _with_comm(profile, args)
    try:
        projections = project(
            graph,
            profile,
            devices=devices,
            global_batch_size=args.global_batch_size,
            amplification_limit=args.amplification_limit,
            background_efficiency=args.background_efficiency,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(table(projections))
    print(assumptions(profile, projections))
    if args.chart:
        _draw(simulation_chart, projections, args.chart)


def _draw(chart: Callable[[Any, str], None], data: Any, path: str) -> None:
    try:
        chart(data, path)
    except ChartError as err:
        raise UsageError(str(err)) from None
    print(f"chart written to {path}")


# ----------------------------------------------------------------------------- graph, profile
def _graph_and_profile(args: argparse.Namespace, *, world_size: int) -> tuple[LayerGraph, Profile]:
    """The model's graph and a profile covering per-device batches ceil(B/N)..B for N <= world_size.

    With --profile and no MODULE_PATH the graph comes from the profile file (written by --profile-out).
    """
    if args.module_path is None:
        return _load_profile_file(args.profile)
    if args.input_shape is None:
        raise UsageError("MODULE_PATH needs --input-shape (the per-sample shape, e.g. 3,32,32)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    captured, env = _capture(args, device)
    if args.profile is not None:
        return captured.graph, _load(Profile.load, args.profile, "profile")
    try:
        sizes = candidate_batch_sizes(args.global_batch_size, world_size)
    except ValueError as err:
        raise UsageError(str(err)) from None
    profile = _measure(captured, env, sizes, args, device)
    if args.profile_out:
        _save_profile_file(args.profile_out, captured.graph, profile)
        print(f"profile written to {args.profile_out}")
    return captured.graph, profile


def _capture(args: argparse.Namespace, device: torch.device) -> tuple[CapturedGraph, dict[str, Any]]:
    """The captured graph of the model and a random four-sample example batch bound to its forward."""
    shape = _parse_shape(args.input_shape)
    dtype = getattr(torch, args.input_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--input-dtype {args.input_dtype!r} is not a torch dtype (e.g. float32, int64)")
    model = _construct(args.module_path, args.config)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"{args.module_path} is a {type(model).__name__}, not a LightningModule or nn.Module"
        )
    if args.module is not None:
        try:
            model = model.get_submodule(args.module)
        except AttributeError:
            children = [name for name, _ in model.named_children()]
            raise UsageError(f"--module {args.module!r}: no such submodule; children: {children}") from None
    model.to(device)
    # Integer inputs (token ids, indices) are zeros: valid for any embedding table.
    example = (
        torch.randn(4, *shape, device=device).to(dtype)
        if dtype.is_floating_point
        else torch.zeros(4, *shape, dtype=dtype, device=device)
    )
    try:
        captured = capture_graph(model, (example,), leaf_modules=args.leaf, granularity=args.granularity)
    except CaptureError as err:
        raise UsageError(str(err)) from None
    except TypeError as err:
        raise UsageError(f"the model's forward must take one batch tensor: {err}") from None
    return captured, captured.bind((example,), {})


def _measure(
    captured: CapturedGraph,
    env: dict[str, Any],
    sizes: list[int],
    args: argparse.Namespace,
    device: torch.device,
) -> Profile:
    """Each layer's forward+backward time at each per-device batch size, on `device`, calibrated by a
    whole pass at the smallest (the full width's at the most devices)."""
    layers = profile_layers(
        captured,
        env,
        sizes,
        warmup=args.warmup,
        repeats=args.repeats,
        device=device,
        progress=progress_printer(),
    )
    whole = time_whole_model(captured, env, sizes[0], warmup=args.warmup, repeats=args.repeats, device=device)
    name, dtype = device_name(device), parameter_dtype(captured.module)
    return Profile(captured.graph.fingerprint, name, dtype, layers).calibrated(whole, sizes[0])


def _with_comm(profile: Profile, args: argparse.Namespace) -> Profile:
    """The profile with the link figures given on the command line (point-to-point and, if given
    apart, collectives), when any is given: they replace what was measured, a figure not given is the
    profile's link's; the buckets, whether all-reduces overlap backward and how much they slow the
    compute beside them stay the profile's."""
    link = _link(args.bandwidth, args.latency_us, "", profile.comm.link)
    collective = _link(args.collective_bandwidth, args.collective_latency_us, "collective-", link)
    if link is None and collective is None:
        return profile
    comm = CommProfile(
        link=link or profile.comm.link,
        collective=collective,
        bucket_bytes=profile.comm.bucket_bytes,
        overlap=profile.comm.overlap,
        contention=profile.comm.contention,
    )
    return dataclasses.replace(profile, comm=comm)


def _link(
    bandwidth_gbps: float | None, latency_us: float | None, prefix: str, given: AlphaBeta | None
) -> AlphaBeta | None:
    """The link of the flags given, the figure not given taken from `given`; None if neither is."""
    if bandwidth_gbps is None and latency_us is None:
        return None
    given = given or CommProfile().link
    if (bandwidth_gbps is not None and bandwidth_gbps <= 0) or (latency_us is not None and latency_us < 0):
        raise UsageError(
            f"--{prefix}bandwidth must be > 0 and --{prefix}latency-us >= 0, "
            f"got {bandwidth_gbps}, {latency_us}"
        )
    seconds_per_byte = 1.0 / (bandwidth_gbps * 1e9) if bandwidth_gbps is not None else given.seconds_per_byte
    latency = latency_us * 1e-6 if latency_us is not None else given.latency_s
    return AlphaBeta(latency, seconds_per_byte)


def _save_profile_file(path: str, graph: LayerGraph, profile: Profile) -> None:
    """A profile file (`Profile.load` reads it) that also carries the graph, for `simulate --profile`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**profile.to_dict(), "graph": graph.to_dict()}, indent=1))


def _load_profile_file(path: str) -> tuple[LayerGraph, Profile]:
    def read(p: str) -> tuple[LayerGraph, Profile]:
        data = json.loads(Path(p).read_text())
        if "graph" not in data:
            raise ValueError("it has no graph; write profiles with `deeppool plan ... --profile-out FILE`")
        return LayerGraph.from_dict(data["graph"]), Profile.from_dict(data)

    return _load(read, path, "profile")


def _load(read: Any, path: str, what: str) -> Any:
    try:
        return read(path)
    except FileNotFoundError:
        raise UsageError(f"{what} file {path!r} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"cannot read {what} file {path!r}: {err}") from None


# ------------------------------------------------------------------------------- the module
def _construct(module_path: str, config: str | None) -> Any:
    """Import ``pkg.module:ClassName`` (or ``path/to/file.py:ClassName``) and construct it."""
    cls = _import_class(module_path)
    init_args = _init_args(config) if config else {}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "model", fail_untyped=False)
    try:
        parsed = parser.parse_object({"model": init_args})
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        return instantiate(parsed).model
    except (argparse.ArgumentError, TypeError, ValueError) as err:
        raise UsageError(f"cannot construct {module_path}: {err}") from None


def _import_class(module_path: str) -> Any:
    module_name, sep, class_name = module_path.rpartition(":")
    if not sep or not module_name or not class_name:
        raise UsageError(f"module path {module_path!r} must look like pkg.module:ClassName")
    # A console script does not put the working directory on sys.path; `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"cannot import {module_name!r} from module path {module_path!r}: {err}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UsageError(f"module {module_name!r} has no class {class_name!r}")
    return cls


def _init_args(config: str) -> dict[str, Any]:
    """``init_args`` from a LightningCLI-style YAML: ``model: {class_path, init_args}``, ``{class_path,
    init_args}``, or a plain mapping of constructor arguments."""
    data = _load(lambda p: yaml.safe_load(Path(p).read_text()), config, "config") or {}
    if not isinstance(data, dict):
        raise UsageError(f"config {config!r} must be a mapping, got {type(data).__name__}")
    data = data.get("model", data)
    if "class_path" in data or "init_args" in data:
        data = data.get("init_args") or {}
    return dict(data)


# ----------------------------------------------------------------------------------- parsing
def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--input-shape {text!r} must be comma-separated positive integers, e.g. 3,32,32"
        ) from None
    if any(size < 1 for size in shape):
        raise UsageError(f"--input-shape {text!r} must be comma-separated positive integers, e.g. 3,32,32")
    return shape


def _parse_pins(pins: Sequence[str]) -> dict[str, int | Placement]:
    """``NAME=WIDTH`` (a width) or ``NAME=WIDTHsSPATIAL`` (a `Placement`: ``features=4s2`` runs on 4
    devices, 2 sample groups, each sample split by height in 2 parts), either followed by ``@FIRST``
    to start at rank FIRST (``text=2@2``: ranks 2 and 3)."""
    parsed: dict[str, int | Placement] = {}
    for pin in pins:
        name, sep, value = pin.rpartition("=")
        if not sep or not re.fullmatch(r"\d+(s\d+)?(@\d+)?", value):
            raise UsageError(
                f"--pin {pin!r} must look like name=width or name=WIDTHsSPATIAL, e.g. classifier=1 or "
                "features=4s2"
            )
        parsed[name] = int(value) if value.isdigit() else Placement.parse(value)
    return parsed


# ---------------------------------------------------------------------------------- parsers
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deeppool", description="Plan, inspect and project DeepPool burst-parallel training."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="profile a model on this machine and plan its layer widths")
    _model_arguments(plan, required=True)
    plan.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    _search_arguments(plan)
    plan.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME=WIDTH",
        help="fix a module (prefix) to a width, or to a width split by height: NAME=4s2 (4 devices, each "
        "sample in 2 parts); @FIRST starts it at rank FIRST: NAME=2@2 (ranks 2 and 3)",
    )
    plan.add_argument("--out", default="plan.json", help="plan file to write (default: plan.json)")
    plan.set_defaults(run=plan_command, subparser=plan)

    show = commands.add_parser("show", help="print a plan file's table")
    show.add_argument("plan", help="plan file (JSON)")
    show.add_argument("--chart", help="save a chart of width and time per layer (needs matplotlib)")
    show.set_defaults(run=show_command, subparser=show)

    simulate = commands.add_parser("simulate", help="project throughput of DDP, burst and background fill")
    _model_arguments(simulate, required=False)
    simulate.add_argument(
        "--devices",
        required=True,
        help="comma-separated device counts, e.g. 8,16,32,64 (more than the batch only for models with "
        "layers that can be split by height)",
    )
    _search_arguments(simulate)
    simulate.add_argument(
        "--background-efficiency",
        type=float,
        default=DEFAULT_BACKGROUND_EFFICIENCY,
        help="share (0..1) of idle device-time background jobs turn into progress "
        f"(default: {DEFAULT_BACKGROUND_EFFICIENCY}, about what a CPU benchmark measured)",
    )
    simulate.add_argument("--chart", help="save a throughput plot (needs matplotlib)")
    simulate.set_defaults(run=simulate_command, subparser=simulate)
    return parser


def _model_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "module_path",
        nargs=None if required else "?",
        help="the LightningModule (or nn.Module) class: pkg.module:ClassName or path/to/file.py:ClassName",
    )
    parser.add_argument("--config", help="YAML with the module's init_args (LightningCLI style)")
    parser.add_argument(
        "--module", help="plan this submodule's forward instead (like DeepPoolStrategy(module=))"
    )
    parser.add_argument("--input-shape", help="per-sample input shape, e.g. 3,32,32")
    parser.add_argument("--input-dtype", default="float32", help="input dtype (default: float32)")
    parser.add_argument(
        "--leaf", action="append", default=[], metavar="NAME", help="plan a submodule as one layer"
    )
    parser.add_argument(
        "--granularity",
        choices=["layer", "module"],
        default="layer",
        help="layer: operations without parameters join the layer they follow (default); "
        "module: every submodule call is a layer",
    )
    parser.add_argument(
        "--device", default=None, help="profiling device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per layer and batch size")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per layer and batch size (median)")
    parser.add_argument("--profile", help="use this profile file instead of profiling")
    parser.add_argument("--profile-out", help="write the measured profile (with the graph) to this file")


def _search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--global-batch-size", type=int, required=True, help="samples per step, all devices")
    parser.add_argument(
        "--amplification-limit", type=float, default=2.0, help="max device-time amplification per layer"
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        help="point-to-point link bandwidth in GB/s (default: the profile's; 20 in one made here)",
    )
    parser.add_argument(
        "--latency-us",
        type=float,
        help="point-to-point latency per message in us (default: the profile's; 20 in one made here)",
    )
    parser.add_argument(
        "--collective-bandwidth",
        type=float,
        help="per-link bandwidth of collectives in GB/s (default: the point-to-point figure)",
    )
    parser.add_argument(
        "--collective-latency-us",
        type=float,
        help="per-link latency of collectives in microseconds (default: the point-to-point figure)",
    )
