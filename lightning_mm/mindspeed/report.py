"""The one report of a migration: the LightningCLI config written and what became of every flag and key.

Every route (a Megatron-route launch, MindSpeed MM's single YAML, its native-route YAML, one component file) returns
a :class:`MigrationReport`; ``lightning-mm migrate`` prints :meth:`MigrationReport.report` and writes ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["MigrationReport", "Route"]

Route = Literal["megatron", "native"]
"""MindSpeed MM's two training routes: Megatron's flags (a launch script, the single YAML, a component file) or the
native FSDP2 trainer's six-section YAML."""


@dataclass
class MigrationReport:
    """The config written and each item ``mapped`` (``source -> target``), ``unmapped`` (with the reason, to
    review by hand) or a ``note``."""

    config: dict[str, Any]
    mapped: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    import_root: Path | None = None
    """Where the entry script's functions import from (lightning-mm must run there)."""
    run_from: Path | None = None
    """The launch directory, where a MindSpeed MM data config's relative paths start (lightning-mm must run there)."""
    rendezvous: dict[str, str] = field(default_factory=dict)
    """torchrun's literal ``master_addr`` / ``master_port`` of a multi-node launch, for the printed launch line."""
    route: Route = "megatron"

    def report(self) -> str:
        lines = [f"mapped {len(self.mapped)} item(s):", *(f"  {m}" for m in self.mapped)]
        if self.notes:
            lines += ["notes:", *(f"  {n}" for n in self.notes)]
        lines.append(f"NOT mapped {len(self.unmapped)} item(s) (review these by hand):")
        lines += [f"  {u}" for u in self.unmapped] or ["  (none)"]
        return "\n".join(lines)
