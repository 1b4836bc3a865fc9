"""One parallel layout: how the ranks of a run split into data (HSDP), tensor, context and expert parallelism.

:class:`ParallelLayout` is pure data (torchtitan's ``ParallelDims`` is the model): the sizes, checked once against the
world size (:func:`parallel_layout`) and the model (:meth:`ParallelLayout.check_model`), every error naming its key.
:class:`LayoutMeshes` is the one mesh builder: every feature takes its device mesh from it, and every
``init_device_mesh`` / ``DeviceMesh`` of the package is called here (:func:`device_mesh`).

The dimensions, in torchtitan's order (outermost first, so the ``tp`` ranks of a group are consecutive):

- ``replicate`` x ``shard``: FSDP2's mesh (HSDP when ``replicate`` > 1); with ``tensor_parallel_size`` > 1 it is
  the data-parallel sub-mesh of the ``(replicate, shard, tp)`` world mesh (2-D: TP inside, FSDP2 across);
- ``dp`` x ``cp``: context parallelism (Ulysses): ``cp`` consecutive ranks share samples; FSDP2 still shards over
  every rank;
- ``ep_replicate`` x ``ep``: expert parallelism: ``ep`` consecutive ranks hold every expert together.

Lightning-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mm.core.config import FSDP2Config, FSDP2ConfigError

__all__ = [
    "LayoutError",
    "ParallelLayout",
    "LayoutMeshes",
    "parallel_layout",
    "config_layout",
    "context_parallel_algorithm",
    "device_mesh",
    "transposed_mesh",
    "own_rank_mesh",
    "data_parallel_mesh_layout",
    "ep_mesh_layout",
    "cp_mesh_layout",
]


class LayoutError(FSDP2ConfigError):
    """A parallel layout that cannot work (raised before any process group or compute)."""


# ------------------------------------------------------------------------------------------------- shapes
def data_parallel_mesh_layout(world_size: int, sharding_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """FSDP2's mesh over ``world_size`` data-parallel ranks: ``(shard,)``, or ``(replicate, shard)`` for HSDP."""
    if sharding_size == world_size:
        return (world_size,), ("shard",)
    return (world_size // sharding_size, sharding_size), ("replicate", "shard")


def ep_mesh_layout(world_size: int, expert_parallel_size: int) -> tuple[tuple[int, int], tuple[str, str]]:
    """The expert mesh: ``(ep_replicate, ep)``; ranks ``r`` with the same ``r // ep`` form one EP group."""
    return (world_size // expert_parallel_size, expert_parallel_size), ("ep_replicate", "ep")


def cp_mesh_layout(world_size: int, context_parallel_size: int) -> tuple[tuple[int, int], tuple[str, str]]:
    """The context-parallel mesh: ``(dp, cp)``; ranks ``r`` with the same ``r // cp`` share samples."""
    return (world_size // context_parallel_size, context_parallel_size), ("dp", "cp")


# ------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of each kind of parallelism over ``world_size`` ranks (build it with :func:`parallel_layout`)."""

    world_size: int
    dp_shard: int
    """Ranks FSDP2 shards parameters over (the config's ``sharding_size``, resolved)."""
    tp: int = 1
    """``tensor_parallel_size``: ranks that split each tensor-parallel layer (consecutive ranks)."""
    cp: int = 1
    """``context_parallel_size``: ranks that split each sequence (consecutive ranks)."""
    ep: int = 1
    """``expert_parallel_size``: ranks that together hold every expert (consecutive ranks)."""
    cp_algo: str = "ulysses"
    """``context_parallel_algo``: ``ulysses`` or ``kv_allgather`` (:mod:`~lightning_mm.core.context_parallel`)."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks of FSDP2's mesh (every rank but the tensor-parallel split)."""
        return self.world_size // self.tp

    @property
    def dp_replicate(self) -> int:
        """HSDP replicas: data-parallel groups that each hold a whole (sharded) copy."""
        return self.dp // self.dp_shard

    @property
    def samplers(self) -> int:
        """Data-parallel ranks that read different samples (``world / (tp x cp)``)."""
        return self.world_size // (self.tp * self.cp)

    @property
    def dp_mesh_shape(self) -> tuple[int, ...]:
        return data_parallel_mesh_layout(self.dp, self.dp_shard)[0]

    @property
    def dp_mesh_dim_names(self) -> tuple[str, ...]:
        return data_parallel_mesh_layout(self.dp, self.dp_shard)[1]

    @property
    def world_mesh_shape(self) -> tuple[int, ...]:
        """FSDP2's mesh with the ``tp`` dimension innermost (the data-parallel mesh alone without TP)."""
        return self.dp_mesh_shape + ((self.tp,) if self.tp > 1 else ())

    @property
    def world_mesh_dim_names(self) -> tuple[str, ...]:
        return self.dp_mesh_dim_names + (("tp",) if self.tp > 1 else ())

    def describe(self) -> str:
        """One line: the sizes of every dimension and what each rank does."""
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.world_mesh_dim_names, self.world_mesh_shape))
        parts = [f"parallel layout: world {self.world_size} = mesh ({mesh})"]
        parts.append(f"tensor_parallel_size {self.tp}")
        parts.append(f"context_parallel_size {self.cp}" + (f" ({self.cp_algo})" if self.cp > 1 else ""))
        parts.append(f"expert_parallel_size {self.ep}")
        parts.append(f"{self.samplers} data-parallel sampler rank(s)")
        return "; ".join(parts)

    def check_model(self, model_config: Any, where: str = "the model") -> None:
        """What tensor parallelism needs of the model's config (``num_attention_heads``, ``num_key_value_heads``,
        ``intermediate_size`` when it has them): each divisible by ``tensor_parallel_size``. The vocabulary is not
        split (embeddings and the output layer stay replicated over the ``tp`` ranks), so it need not divide."""
        if self.tp == 1 or model_config is None:
            return
        for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(model_config, attr, None)
            if isinstance(value, int) and value % self.tp:
                raise LayoutError(
                    f"FSDP2 config key `tensor_parallel_size`: {self.tp} does not divide {where}'s {attr} {value} "
                    "(tensor parallelism splits it evenly over the ranks); choose a divisor"
                )
        if self.cp == 1 or self.cp_algo != "ulysses":
            return
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(model_config, attr, None)
            if isinstance(value, int) and (value // self.tp) % self.cp:
                raise LayoutError(
                    f"FSDP2 config key `context_parallel_size`: {self.cp} does not divide {where}'s {attr} {value} / "
                    f"tensor_parallel_size {self.tp} = {value // self.tp} heads per rank (Ulysses scatters each "
                    "rank's heads over its context-parallel group); choose a divisor or context_parallel_algo "
                    "kv_allgather"
                )


def _positive(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"FSDP2 config key `{key}`{where}: expected a positive integer, got {value!r}")
    return value


def parallel_layout(
    world_size: int,
    sharding_size: int | str = "auto",
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    source: str | None = None,
) -> ParallelLayout:
    """Check the sizes against ``world_size`` (each must divide it; ``sharding_size`` the data-parallel ranks
    ``world / tensor_parallel_size``) and what does not compose yet; every error names its key (and ``source``,
    the config's file)."""
    where = f" in {source}" if source else ""
    tp = _positive(tensor_parallel_size, "tensor_parallel_size", where)
    cp = _positive(context_parallel_size, "context_parallel_size", where)
    ep = _positive(expert_parallel_size, "expert_parallel_size", where)
    for key, size in (("tensor_parallel_size", tp), ("context_parallel_size", cp), ("expert_parallel_size", ep)):
        if world_size % size:
            raise LayoutError(f"FSDP2 config key `{key}`{where}: {size} does not divide the world size {world_size}")
    dp = world_size // tp
    shard = dp if sharding_size == "auto" else _positive(sharding_size, "sharding_size", where)
    if shard > dp or dp % shard:
        per = f" / tensor_parallel_size {tp} = {dp} data-parallel ranks" if tp > 1 else ""
        raise LayoutError(
            f"FSDP2 config key `sharding_size`{where}: {shard} does not divide the world size {world_size}{per} "
            "(use 'auto' or a divisor)"
        )
    if world_size % (tp * cp):
        raise LayoutError(
            f"FSDP2 config key `context_parallel_size`{where}: {cp} x tensor_parallel_size {tp} does not divide the "
            f"world size {world_size}"
        )
    return ParallelLayout(world_size, shard, tp, cp, ep)


def context_parallel_algorithm(config: FSDP2Config, argument: str | None = None) -> str:
    """The config's ``context_parallel_algo``, or the strategy's argument of that name (an alias; ``None``: unset),
    refused when both are set and differ."""
    from lightning_mm.core.cp_algorithms import canonical_algorithm

    algo = config.context_parallel_algo
    if argument is None:
        return algo
    given = canonical_algorithm(argument)
    if "context_parallel_algo" in config.explicit_keys and given != algo:
        raise config.key_error(
            "context_parallel_algo",
            f"{algo}, but the strategy was given context_parallel_algo={argument!r}; set it in one place",
        )
    return given


def config_layout(
    config: FSDP2Config,
    world_size: int,
    context_parallel_size: int | None = None,
    context_parallel_algo: str | None = None,
) -> ParallelLayout:
    """The layout of ``config`` over ``world_size`` ranks; ``context_parallel_size`` / ``context_parallel_algo``: the
    strategy's arguments of those names (aliases of the keys; ``None`` or size 1: the key's value), refused when
    both are set and differ."""
    cp = config.context_parallel_size
    if context_parallel_size is not None and context_parallel_size != 1:
        if cp not in (1, context_parallel_size):
            raise config.key_error(
                "context_parallel_size",
                f"{cp}, but the strategy was given context_parallel_size={context_parallel_size}; set it in one place",
            )
        cp = context_parallel_size
    layout = parallel_layout(
        world_size,
        config.sharding_size,
        config.tensor_parallel_size,
        cp,
        config.expert_parallel_size,
        config.source,
    )
    return replace(layout, cp_algo=context_parallel_algorithm(config, context_parallel_algo))


# --------------------------------------------------------------------------------------------------- meshes
def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """An explicit mesh on ``device_type`` (CPU included: a gloo run without one picks the wrong device); the one
    ``init_device_mesh`` call of the package (every rank calls it: it creates process groups)."""
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def transposed_mesh(mesh: DeviceMesh, names: tuple[str, str]) -> DeviceMesh:
    """The 2-D ``mesh`` with its dimensions swapped, named ``names`` (new process groups: every rank calls it)."""
    return DeviceMesh(mesh.device_type, mesh.mesh.t().contiguous(), mesh_dim_names=names)


def own_rank_mesh(device_type: str) -> DeviceMesh:
    """A 1-rank mesh of this rank alone (every rank calls this: it creates one process group per rank)."""
    return device_mesh(device_type, (dist.get_world_size(), 1), ("world", "alone"))["alone"]


class LayoutMeshes:
    """The meshes of one run, built on first use from its :class:`ParallelLayout` (each once)."""

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.layout = layout
        self.device_type = device_type
        self._built: dict[str, DeviceMesh] = {}

    def _get(self, name: str, build: Callable[[], DeviceMesh]) -> DeviceMesh:
        if name not in self._built:
            self._built[name] = build()
        return self._built[name]

    @property
    def world(self) -> DeviceMesh:
        """FSDP2's mesh with ``tp`` innermost: ``(shard[, tp])`` or ``(replicate, shard[, tp])``."""
        lay = self.layout
        return self._get("world", lambda: device_mesh(self.device_type, lay.world_mesh_shape, lay.world_mesh_dim_names))

    @property
    def data_parallel(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``(shard,)`` or ``(replicate, shard)`` (a sub-mesh of :attr:`world`)."""
        if self.layout.tp == 1:
            return self.world
        return self._get("dp", lambda: self.world[self.layout.dp_mesh_dim_names])

    @property
    def tensor_parallel(self) -> DeviceMesh:
        """The 1-D ``tp`` sub-mesh of :attr:`world`."""
        if self.layout.tp == 1:
            raise LayoutError("tensor_parallel_size is 1: there is no tensor-parallel mesh")
        return self._get("tp", lambda: self.world["tp"])

    @property
    def context_parallel(self) -> DeviceMesh:
        """The ``(dp, cp)`` mesh of context parallelism (with tensor parallelism a sub-mesh of ``(dp, cp, tp)``)."""
        lay = self.layout
        if lay.tp > 1:  # every tp-th rank: (dp, cp, tp), tp innermost as in the world mesh
            shape3 = (lay.world_size // (lay.cp * lay.tp), lay.cp, lay.tp)
            return self._get("cp", lambda: device_mesh(self.device_type, shape3, ("dp", "cp", "tp"))[("dp", "cp")])
        shape, names = cp_mesh_layout(lay.world_size, lay.cp)
        return self._get("cp", lambda: device_mesh(self.device_type, shape, names))

    @property
    def expert_parallel(self) -> DeviceMesh:
        """The ``(ep_replicate, ep)`` mesh of expert parallelism."""
        shape, names = ep_mesh_layout(self.layout.world_size, self.layout.ep)
        return self._get("ep", lambda: device_mesh(self.device_type, shape, names))
