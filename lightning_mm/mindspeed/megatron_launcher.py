"""The launcher of a Megatron-route launch: torchrun's process counts -> ``trainer.devices`` / ``trainer.num_nodes``,
and a multi-node launch's rendezvous (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) named for the launch line."""

from __future__ import annotations

from lightning_mm.mindspeed.flags import FlagState, set_path
from lightning_mm.mindspeed.launch_script import UNEVALUATED, Launch

__all__ = ["map_launcher"]


def map_launcher(state: FlagState, launch: Launch) -> int | None:
    """torchrun's process counts; returns the world size when it is known."""
    cfg, out = state.cfg, state.out
    world = None
    nproc = launch.launcher.get("nproc_per_node")
    nnodes = launch.launcher.get("nnodes")
    if nproc and nproc.isdigit():
        set_path(cfg, "trainer.devices", int(nproc))
        out.mapped.append(f"torchrun --nproc_per_node {nproc} -> trainer.devices")
        world = int(nproc) * (int(nnodes) if nnodes and nnodes.isdigit() else 1)
    if nnodes and nnodes.isdigit():
        set_path(cfg, "trainer.num_nodes", int(nnodes))
        out.mapped.append(f"torchrun --nnodes {nnodes} -> trainer.num_nodes")
    for key in ("nproc_per_node", "nnodes"):
        value = launch.launcher.get(key)
        if value is not None and not value.isdigit():
            target = "trainer.devices" if key == "nproc_per_node" else "trainer.num_nodes"
            why = (
                "comes from shell that migrate does not run (see the notes)" if UNEVALUATED in value else "not a number"
            )
            out.unmapped.append(f"torchrun --{key} {value}: {why}; set {target}")
    _map_rendezvous(state, launch, int(nnodes) if nnodes and nnodes.isdigit() else None)
    return world


_RENDEZVOUS = ("node_rank", "master_addr", "master_port")
"""torchrun's per-launch options: the printed launch lines carry them, the YAML does not."""


def _map_rendezvous(state: FlagState, launch: Launch, nnodes: int | None) -> None:
    """``--node_rank`` / ``--master_addr`` / ``--master_port``: on several nodes, a literal address and port go
    into the printed torchrun line (:func:`launch_lines`) and the node rank is each node's own; a value from shell
    migrate does not run, or a placeholder, is NOT mapped with that reason. On one node torchrun's local
    rendezvous needs none of them."""
    out = state.out
    for key in launch.launcher:
        if key in ("nproc_per_node", "nnodes"):
            continue
        value = launch.launcher[key]
        shown = f"torchrun --{key} {value}" if value is not None else f"torchrun --{key}"
        if key not in _RENDEZVOUS:
            out.unmapped.append(f"{shown}: a torchrun option lightning-mm's launch lines do not take; set it by hand")
        elif value is None or UNEVALUATED in value:
            out.unmapped.append(
                f"{shown}: comes from shell that migrate does not run (see the notes); give it on the torchrun "
                "line of each node"
            )
        elif not _literal(value):
            out.unmapped.append(f"{shown}: not a literal value (a placeholder); give it on the torchrun line")
        elif nnodes == 1:
            out.notes.append(f"{shown}: one node: torchrun's local rendezvous, nothing to set")
        elif nnodes is None:
            out.unmapped.append(f"{shown}: the node count is not known (see --nnodes); give it on the torchrun line")
        elif key == "node_rank":
            out.mapped.append(
                f"{shown} -> the printed torchrun line's --node_rank $NODE_RANK (each node its own, 0..{nnodes - 1})"
            )
        else:
            out.rendezvous[key] = value
            out.mapped.append(f"{shown} -> the printed torchrun line (--{key} {value})")


def _literal(value: str) -> bool:
    """A value written out (an address, a port), not a placeholder such as ``<master_ip_address>``."""
    return bool(value) and not any(c in value for c in "<>$`{} ")
