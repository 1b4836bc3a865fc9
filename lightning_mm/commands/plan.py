"""``lightning-mm plan --config cfg.yaml [--world-size N]``: the resolved sharding plan, without processes.

The model of a LightningCLI config is built with its parameters on the meta device (no weights are allocated),
the FSDP2 config is resolved against it exactly as the strategy does at setup, and the plan is printed with the
per-rank bytes of parameters, gradients and optimiser state.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "plan_from_cli_config"]


def plan_from_cli_config(cli_args: Sequence[str], world_size: int | None = None, optimizer_states: int = 2) -> str:
    """Build the plan for a LightningCLI argument list (``["--config", "cfg.yaml", ...]``) and describe it."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_mm import MMDataModule, MMFSDP2Strategy, MMLightningModule
    from lightning_mm.strategies.config import FSDP2Config
    from lightning_mm.strategies.init_context import meta_parameters
    from lightning_mm.strategies.memory import per_rank_memory
    from lightning_mm.strategies.plan import build_plan
    from lightning_mm.strategies.precision import resolve_mixed_precision

    saved_argv = sys.argv
    sys.argv = [saved_argv[0]]  # LightningCLI warns when it sees both `args` and command-line arguments
    try:
        cli = LightningCLI(
            MMLightningModule, MMDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
            args=list(cli_args), save_config_callback=None,
        )
    finally:
        sys.argv = saved_argv
    trainer, module = cli.trainer, cli.model
    strategy = trainer.strategy
    if not isinstance(strategy, MMFSDP2Strategy):
        raise SystemExit(f"the config's strategy is {type(strategy).__name__}, not MMFSDP2Strategy (mm_fsdp2)")
    with meta_parameters():
        module.configure_model()
    target = module.model if isinstance(module, MMLightningModule) else module
    config = FSDP2Config.load(strategy._given_config) if strategy._given_config is not None else None
    if config is None:
        given = getattr(module, "fsdp2_config", None)
        config = FSDP2Config.load(given) if given is not None else FSDP2Config(sharding_size="auto")
    config = config.with_model_defaults(target)
    world = world_size or trainer.num_nodes * trainer.num_devices
    precision = resolve_mixed_precision(config, str(trainer.precision_plugin.precision))
    plan = build_plan(config, target, world, precision)
    memory = per_rank_memory(target, plan, optimizer_states)
    order = _execution_order(module, target, plan, cli.datamodule)
    return plan.describe() + "\n" + order + "\n" + memory.describe()


def _execution_order(module: Any, target: Any, plan: Any, datamodule: Any) -> str:
    """Units in the order one batch runs through them, from a forward pass on the meta device (no compute)."""
    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    order: list[str] = []
    handles = []
    for unit in plan.units:
        for path in unit.modules:
            def record(*_: Any, name: str = unit.name) -> None:
                if name not in order:
                    order.append(name)

            handles.append(target.get_submodule(path).register_forward_pre_hook(record))
    try:
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
        batch = apply_to_collection(batch, torch.Tensor, lambda t: t.to("meta"))
        target.to("meta")  # buffers too: this throwaway model only runs to reveal the order
        with torch.no_grad():
            module._run(batch) if hasattr(module, "_run") else module.training_step(batch, 0)
    except Exception as err:  # the order is then taken at the first training step, as always
        return f"  prefetch order: decided at the first training step (a meta-device forward failed: {err})"
    finally:
        for handle in handles:
            handle.remove()
    return "  prefetch order (one batch, meta-device forward): " + " -> ".join(order)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-mm plan", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks to plan for (default: the config's num_nodes x devices)")
    parser.add_argument("--optimizer-states", type=int, default=2,
                        help="optimiser tensors per parameter (2 for Adam/AdamW)")
    args, rest = parser.parse_known_args(list(argv))
    if not rest:
        parser.error("give the LightningCLI config, e.g. --config cfg.yaml")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be positive")
    print(plan_from_cli_config(rest, args.world_size, args.optimizer_states))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
