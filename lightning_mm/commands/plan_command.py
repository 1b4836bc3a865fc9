"""``lightning-mm plan --config cfg.yaml [--world-size N]``: the resolved sharding plan, without processes.

The model of a LightningCLI config is built with its parameters on the meta device (no weights are allocated),
the FSDP2 config is resolved against it exactly as the strategy does at setup, and the plan is printed with the
per-rank bytes of parameters, gradients and optimiser state. No Trainer is built: the config's accelerator and
devices need not exist here (plan a 64-NPU run on a laptop with ``--world-size 64``), and nothing is checked
against the config's own device count when ``--world-size`` is given. The data section is not read unless
``--trace-order`` asks for the units' execution order (it then sets the data module up and takes one batch).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from lightning_mm.errors import ConfigError

__all__ = ["main", "plan_from_cli_config", "planned_cli_config", "world_size_of"]


def world_size_of(devices: Any, num_nodes: Any) -> int:
    """The world size a Trainer would get from ``devices`` x ``num_nodes`` when that is fixed by the config."""
    count: int | None = None
    if isinstance(devices, int) and devices > 0:
        count = devices
    elif isinstance(devices, (list, tuple)) and devices:
        count = len(devices)
    elif isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        count = int(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    if count is None:
        raise ConfigError(f"trainer.devices is {devices!r}, which depends on the machine; give --world-size N")
    nodes = int(num_nodes or 1)
    return count * nodes


def _load_cli(cli_args: Sequence[str], with_data: bool = False) -> Any:
    """The LightningCLI of a config with model and strategy instantiated, and no Trainer.

    The data module is instantiated only ``with_data`` (``--trace-order``): planning needs the model and the
    strategy alone, so a data section that cannot be read on this machine never stops a plan. ``ckpt_path`` (a key
    of ``lightning-mm fit`` configs, which ``migrate`` writes) is accepted and not used.
    """
    from lightning.pytorch.cli import LightningCLI

    import lightning_mm

    lightning_mm.register()
    from lightning_mm import MMDataModule, MMLightningModule

    class _PlanCLI(LightningCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            return None  # a Trainer would resolve accelerator and devices on this machine

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--ckpt_path", type=str | None, default=None, help="not used by plan")

        def instantiate_classes(self) -> None:
            if not with_data:
                self.config["data"] = None
            super().instantiate_classes()

    saved_argv = sys.argv
    sys.argv = [saved_argv[0]]  # LightningCLI warns when it sees both `args` and command-line arguments
    # The config's `seed_everything` seeds the process and sets PL_GLOBAL_SEED, which every process started later
    # inherits (Lightning's samplers read it): planning must leave both as they were.
    import numpy
    import torch

    saved_env = {key: os.environ.get(key) for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    saved_random, saved_numpy = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return _PlanCLI(
                MMLightningModule,
                MMDataModule if with_data else None,  # None: any data module, or none, is accepted
                subclass_mode_model=True,
                subclass_mode_data=True,
                run=False,
                args=list(cli_args),
                save_config_callback=None,
            )
    finally:
        sys.argv = saved_argv
        random.setstate(saved_random)
        numpy.random.set_state(saved_numpy)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def plan_from_cli_config(
    cli_args: Sequence[str],
    world_size: int | None = None,
    optimizer_states: int = 2,
    trace_order: bool = False,
    seq_length: int | None = None,
) -> str:
    """Build the plan for a LightningCLI argument list (``["--config", "cfg.yaml", ...]``) and describe it."""
    strategy, module, planned, world, datamodule = planned_cli_config(cli_args, world_size, with_data=trace_order)
    from lightning_mm.core.memory import per_rank_memory

    target, plan, config = planned.target, planned.plan, planned.config
    memory = per_rank_memory(target, plan, optimizer_states)
    if trace_order:
        order = _execution_order(module, target, plan, datamodule)
    else:
        order = (
            "  prefetch order: decided at the first training step (--trace-order shows it from one batch on the "
            "meta device; it sets up the data module)"
        )
    from lightning_mm.core.parallel_layout import config_layout
    from lightning_mm.core.sharding_plan import describe_rank_shapes

    layout = config_layout(config, world, strategy.context_parallel_size, strategy.requested_context_parallel_algo)
    text = plan.describe() + "\n" + order + "\n" + memory.describe() + "\n" + describe_rank_shapes(target, plan)
    from lightning_mm.hf.plan_source import default_plan_summary

    explicit = sorted(config.explicit_keys)
    source = default_plan_summary(target, explicit, config.ignored_modules if "ignored_modules" in explicit else None)
    if source:
        text += "\n" + source
    if layout.cp > 1 or seq_length:
        from lightning_mm.hf.cp_attention import context_parallel_summary

        text += "\n" + context_parallel_summary(
            target,
            world,
            layout.cp,
            layout.cp_algo,
            seq_length,
            handled=bool(getattr(module, "handles_context_parallel", False)),
            tp=layout.tp,
        )
    return text


def planned_cli_config(
    cli_args: Sequence[str], world_size: int | None = None, with_data: bool = False
) -> tuple[Any, Any, Any, int, Any]:
    """``(strategy, module, planned, world_size, datamodule)`` for a LightningCLI config: the model built on the
    meta device and planned by the config's own strategy (:meth:`MMFSDP2Strategy.plan_for`, what its ``setup``
    applies), with the config's ``precision``. The data module is built only ``with_data`` (else ``None``)."""
    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.core.init_context import meta_parameters
    from lightning_mm.core.precision_policy import check_supported_precision
    from lightning_mm.strategies.precision import MMFSDP2Precision

    cli = _load_cli(cli_args, with_data)
    trainer_config = cli.config_init["trainer"]
    strategy = trainer_config.get("strategy")
    if strategy == MMFSDP2Strategy.strategy_name:
        strategy = MMFSDP2Strategy()
    if not isinstance(strategy, MMFSDP2Strategy):
        shown = type(strategy).__name__ if not isinstance(strategy, str) else repr(strategy)
        raise ConfigError(f"trainer.strategy is {shown}, not MMFSDP2Strategy (mm_fsdp2): nothing to plan")
    world = world_size or world_size_of(trainer_config.get("devices"), trainer_config.get("num_nodes"))
    strategy.precision_plugin = MMFSDP2Precision(check_supported_precision(str(trainer_config.get("precision"))))
    module = cli.model
    with strategy.precision_plugin.tensor_init_context(), meta_parameters():  # the strategy's, always on meta
        module.configure_model()
    return strategy, module, strategy.plan_for(module, world), world, cli.datamodule


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
            module.compute_loss(batch) if hasattr(module, "compute_loss") else module.training_step(batch, 0)
    except Exception as err:  # the order is then taken at the first training step, as always
        return f"  prefetch order: decided at the first training step (a meta-device forward failed: {err})"
    finally:
        for handle in handles:
            handle.remove()
    return "  prefetch order (one batch, meta-device forward): " + " -> ".join(order)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-mm plan", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of ranks to plan for (default: the config's num_nodes x devices)",
    )
    parser.add_argument(
        "--optimizer-states", type=int, default=2, help="optimiser tensors per parameter (2 for Adam/AdamW)"
    )
    parser.add_argument(
        "--trace-order",
        action="store_true",
        help="also show the units' execution order from one batch (sets up the data module)",
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per sequence: show the tokens and decoder activation memory per rank",
    )
    args, rest = parser.parse_known_args(list(argv))
    if not rest:
        parser.error("give the LightningCLI config, e.g. --config cfg.yaml")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be positive")
    from lightning_mm.mindspeed.load import require_lightning_mm_config

    for i, arg in enumerate(rest):  # MindSpeed MM's own files are migrated first, with a sentence saying so
        if arg.startswith("--config="):
            require_lightning_mm_config(arg.split("=", 1)[1], "plan")
        elif arg in ("--config", "-c") and i + 1 < len(rest):
            require_lightning_mm_config(rest[i + 1], "plan")
    print(plan_from_cli_config(rest, args.world_size, args.optimizer_states, args.trace_order, args.seq_length))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
