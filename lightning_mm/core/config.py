"""The FSDP2 YAML config of MindSpeed MM, typed and strictly validated.

The field names, values and defaults follow MindSpeed MM's table (see ``docs/``). Unlike the system this replaces,
an unknown key, a wrong type or an unknown dtype is an error that names the key (and the file it came from).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_mm._utils.suggestions import find_unknown_key
from lightning_mm._utils.yaml_io import load_mapping, short_repr
from lightning_mm.errors import ConfigError, MissingFileError

__all__ = ["FSDP2Config", "FSDP2ConfigError", "parse_dtype"]


class FSDP2ConfigError(ConfigError):
    """An FSDP2 config that cannot be used as written."""


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value: Any, key: str = "dtype") -> torch.dtype | None:
    """Turn ``bf16``/``fp16``/``fp32`` (or a torch dtype or its name) into a ``torch.dtype``; ``None`` stays."""
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values()):
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    raise FSDP2ConfigError(
        f"`{key}`: unknown dtype {short_repr(value)}; use one of bf16, fp16, fp32 (or bfloat16, float16, float32)"
    )


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


class _ExplicitKeys:
    # The attribute FSDP2Config.__new__ sets, declared outside the dataclass: an annotation in its body would be a
    # field (compared, copied by dataclasses.replace, listed by fields()).
    _explicit: frozenset[str]


@dataclass
class FSDP2Config(_ExplicitKeys):
    """MindSpeed MM's FSDP2 sharding config.

    Module paths in ``sub_modules_to_wrap``, ``ignored_modules`` and ``recompute_modules`` are relative to the
    model (``MMLightningModule.model``, or the LightningModule itself for a plain one) and may use MindSpeed MM's
    pattern syntax: ``layers.{*}`` (every child), ``layers.{0-23}`` (a range), ``layers.{1,3,5}`` (a list) and
    mixtures such as ``layers.{0-3,7}``.

    Build it in Python, with :meth:`from_dict` or with :meth:`from_yaml`; all three validate the values.
    """

    sharding_size: Literal["auto"] | int = 1
    """Ranks in each shard group; ``auto`` is the world size. A size below the world size gives HSDP (parameters
    sharded within a group, replicated across groups); it must divide the world size. 1 replicates (no sharding)."""
    param_dtype: torch.dtype | None = None
    """The dtype parameters are gathered and computed in (``bf16``, ``fp16``, ``fp32``); unset keeps the model's
    (bf16 under ``Trainer(precision="bf16-mixed")``; a contradicting Trainer precision is an error)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are reduced in across ranks; unset follows ``param_dtype`` (fp32 under
    ``precision="bf16-mixed"``)."""
    output_dtype: torch.dtype | None = None
    """The dtype each unit's floating-point outputs are cast to; unset leaves them as computed."""
    cast_forward_inputs: bool = True
    """Cast each unit's floating-point inputs to ``param_dtype`` (and ignored modules' inputs to their own dtype)."""
    sub_modules_to_wrap: list[str] = field(default_factory=list)
    """The modules (patterns allowed) sharded as FSDP units of their own; the root holds the rest. Unset: the
    model's default plan, if it has one."""
    ignored_modules: list[str] = field(default_factory=list)
    """The modules (patterns allowed) kept out of FSDP: replicated whole, their trainable gradients all-reduced."""
    recompute_modules: list[str] = field(default_factory=list)
    """The modules (patterns allowed) whose activations are recomputed in backward instead of kept."""
    use_reentrant: bool = True
    """Recompute with the reentrant checkpoint implementation (``true``) or the non-reentrant one."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (ZeRO-3, less memory) or keep them for backward
    (``false``: ZeRO-2, less communication)."""
    offload_to_cpu: bool = False
    """Keep the sharded parameters, gradients and optimiser step on the CPU (FSDP2's CPU offload policy)."""
    pin_memory: bool = False
    """Pin the offloaded CPU memory (faster copies); only with ``offload_to_cpu: true``."""
    num_to_forward_prefetch: int = 0
    """Units whose parameters are gathered ahead in forward, in the order the units run (0: none ahead)."""
    num_to_backward_prefetch: int = 1
    """Units whose parameters are gathered ahead in backward, in the reverse of the forward order."""
    align_fsdp_param_groups: bool = False
    """Gather the norms and routers of the wrapped units (and the final norm) into one FSDP unit of their own."""
    expert_parallel_size: int = 1
    """Split the experts of each ``moe_modules`` module over this many ranks (1: no expert parallelism)."""
    moe_modules: list[str] = field(default_factory=list)
    """The expert modules (patterns allowed) that expert parallelism splits."""
    reshard_local_experts: bool = True
    """With expert parallelism: FSDP-shard the local experts over the ranks that hold the same experts."""
    tensor_parallel_size: int = 1
    """Split each layer of the language model's tensor-parallel plan (``tp_plan``) over this many consecutive
    ranks with DTensor (1: none); FSDP2 then shards over the ``world / tensor_parallel_size`` data-parallel ranks
    (2-D). It must divide the world size, and the model's attention heads, key/value heads and MLP width."""
    tp_plan: dict[str, str] | None = None
    """The tensor-parallel plan (module pattern -> ``colwise``, ``rowwise``, ...; Transformers' notation); unset:
    the model's own ``base_model_tp_plan``. Only with ``tensor_parallel_size`` > 1."""
    context_parallel_size: int = 1
    """Split each sequence over this many consecutive ranks (context parallelism, see ``context_parallel_algo``;
    1: none). The strategy's ``context_parallel_size`` argument is the same setting (conflicting values are an
    error)."""
    context_parallel_algo: str = "ulysses"
    """How attention runs over the ``context_parallel_size`` ranks: ``ulysses`` (all-to-all over the heads; the heads
    must divide by the size) or ``kv_allgather`` (each rank keeps its zig-zag query chunks and gathers keys and
    values: any head count, load-balanced for causal masks). MindSpeed MM's ``ulysses_cp_algo`` and
    ``megatron_cp_algo`` (ring attention) are accepted as these. The strategy's ``context_parallel_algo`` argument
    is the same setting."""
    compile_modules: list[str] = field(default_factory=list)
    """The modules (patterns allowed) whose forward ``torch.compile`` compiles, each as one graph, before sharding
    (recomputation wraps the compiled forward; FSDP2's hooks stay eager around it). None by default; the root
    always stays eager. A module that holds FSDP units or expert-parallel experts cannot be compiled (an error):
    with expert parallelism, compile modules inside the blocks (``model.layers.{*}.self_attn``)."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend for ``compile_modules``: ``inductor`` (generated kernels), ``aot_eager``
    (captured graphs run by eager kernels: a check of capture), or any registered backend by name."""
    encoder_dp_balance: bool = False
    """Deal the vision tower's images out over all ranks before it runs, evening out the estimated cost (MindSpeed
    MM's ``--encoder-dp-balance``): each rank encodes whole images and the features return to their owners' image
    tokens (all-to-all; exact gradients). For towers that take ``grid_thw`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    encoder_dp_balance_cost: list[float] | None = None
    """The cost model ``[linear, quadratic]`` of one image: ``linear * patches + quadratic * attention`` (attention:
    the squared attention spans, per window for window layers). Unset: calibrated by timing the tower on the first
    ``encoder_dp_balance_calibration_steps`` calls (patches alone until then)."""
    encoder_dp_balance_calibration_steps: int = 4
    """Tower calls timed on every rank to fit the cost model when ``encoder_dp_balance_cost`` is unset."""
    source: str | None = field(default=None, compare=False, repr=False)
    """Where the config came from (a file path), used in error messages only."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDP2Config:
        # Record which keys the caller set (the YAML's keys, through from_dict), whatever their values: a key set
        # explicitly wins over the model's defaults even when it equals the default (``ignored_modules: []``).
        self = super().__new__(cls)
        names = [f.name for f in fields(cls)]
        self._explicit = (frozenset(names[: len(args)]) | frozenset(kwargs)) - {"source"}
        return self

    def __post_init__(self) -> None:
        self._validate()

    @property
    def explicit_keys(self) -> frozenset[str]:
        """The keys set explicitly (present in the YAML or dict, or passed to the constructor)."""
        return self._explicit

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> FSDP2Config:
        """Build a config from a mapping; unknown keys are an error suggesting the nearest valid key.

        Only this project's keys: MindSpeed MM's native ``parallel:`` section (or a whole native config) is read by
        :func:`lightning_mm.mindspeed.load.fsdp2_config`, which ``MMFSDP2Strategy(fsdp2_config=...)`` calls.
        """
        where = f" in {source}" if source else ""
        if not isinstance(data, Mapping):
            raise FSDP2ConfigError(
                f"FSDP2 config{where} must be a mapping of keys to values, got {type(data).__name__}"
            )
        known = [f.name for f in fields(cls) if f.name != "source"]
        unknown = find_unknown_key(data, known)
        if unknown is not None:
            shown, hint = unknown
            raise FSDP2ConfigError(f"unknown FSDP2 config key `{shown}`{where}{hint}")
        # An empty YAML value (``ignored_modules:``) means "not set": the default applies.
        values = {k: v for k, v in data.items() if v is not None or k in _NULLABLE}
        return cls(**values, source=source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> FSDP2Config:
        """Read a YAML file with the project's bounded safe loader (:mod:`lightning_mm._utils.yaml_io`) and validate it.

        An empty file (or one with only comments) means "all defaults"; any other top level that is not a
        mapping, a duplicate key, non-UTF-8 bytes or an alias bomb is an error naming the file.
        """
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"FSDP2 config file not found: {path}")
        return cls.from_dict(load_mapping(path, error=FSDP2ConfigError), source=str(path))

    @classmethod
    def load(cls, value: FSDP2Config | Mapping[str, Any] | str | os.PathLike | None) -> FSDP2Config:
        """Accept what a user may hand the strategy: a config, a dict, a YAML path, or ``None`` (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, FSDP2Config):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_yaml(value)
        raise FSDP2ConfigError(
            f"fsdp2_config must be a YAML path, a dict or an FSDP2Config, got {type(value).__name__}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-ready values (dtypes by their short names)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}
        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            out[key] = _dtype_name(out[key])
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in out.items()}
        return out

    def with_model_defaults(self, model: Any) -> FSDP2Config:
        """Fill the keys this config does not set from ``model.default_fsdp2_config()`` (FSDP2Mixin).

        This is how an adapted model supplies its own ``sub_modules_to_wrap`` when the YAML omits it. A key the
        YAML sets always wins, even when its value is the default (``ignored_modules: []`` keeps a frozen tower
        sharded). A provider that takes an ``explicit`` argument gets the keys set explicitly, so that its
        defaults can agree with them (no default unit inside an explicitly ignored module).
        """
        provider = getattr(model, "default_fsdp2_config", None)
        if not callable(provider):
            return self
        explicit = {key: getattr(self, key) for key in sorted(self._explicit)}
        try:
            takes_explicit = "explicit" in inspect.signature(provider).parameters
        except (TypeError, ValueError):
            takes_explicit = False
        defaults = provider(explicit=explicit) if takes_explicit else provider()
        if not defaults:
            return self
        unknown = sorted(set(defaults) - {f.name for f in fields(self)})
        if unknown:
            raise FSDP2ConfigError(f"{type(model).__name__}.default_fsdp2_config() has unknown keys: {unknown}")
        changes = {k: v for k, v in defaults.items() if k not in self._explicit}
        if not changes:
            return self
        filled = dataclasses.replace(self, **changes)
        filled._explicit = self._explicit  # the model's defaults are not the user's choice
        return filled

    # --------------------------------------------------------------- validation
    def key_error(self, key: str | None, message: str) -> FSDP2ConfigError:
        """The error to raise for this config's ``key`` (``None``: the config as a whole), naming its file.

        ``FSDP2 config key `KEY` in FILE: MESSAGE`` (``FSDP2 config in FILE: MESSAGE`` without a key; no ``in FILE``
        for a config built in Python). Validation here and planning
        (:func:`lightning_mm.core.sharding_plan.build_plan`) word
        every config error so.
        """
        where = f" in {self.source}" if self.source else ""
        if key is None:
            return FSDP2ConfigError(f"FSDP2 config{where}: {message}")
        return FSDP2ConfigError(f"FSDP2 config key `{key}`{where}: {message}")

    def _validate(self) -> None:
        bad_size = f"expected 'auto' or a positive integer, got {short_repr(self.sharding_size)}"
        if isinstance(self.sharding_size, str):
            if self.sharding_size.strip().lower() != "auto":
                raise self.key_error("sharding_size", bad_size)
            self.sharding_size = "auto"
        elif isinstance(self.sharding_size, bool) or not isinstance(self.sharding_size, int):
            raise self.key_error("sharding_size", bad_size)
        elif self.sharding_size <= 0:
            raise self.key_error("sharding_size", f"must be positive, got {self.sharding_size}")

        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            try:
                setattr(self, key, parse_dtype(getattr(self, key), key))
            except FSDP2ConfigError as err:
                raise self.key_error(key, str(err).split(": ", 1)[1]) from None

        for key in (
            "cast_forward_inputs",
            "use_reentrant",
            "reshard_after_forward",
            "offload_to_cpu",
            "pin_memory",
            "align_fsdp_param_groups",
            "reshard_local_experts",
        ):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise self.key_error(key, f"expected true or false, got {short_repr(value)}")

        for key in _PATTERN_KEYS:
            value = getattr(self, key)
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
                raise self.key_error(key, f"expected a list of module path strings, got {short_repr(value)}")
            setattr(self, key, [v.strip() for v in value])

        for key in ("num_to_forward_prefetch", "num_to_backward_prefetch"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self.key_error(key, f"expected a non-negative integer, got {short_repr(value)}")

        for key in ("expert_parallel_size", "tensor_parallel_size", "context_parallel_size"):
            size = getattr(self, key)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self.key_error(key, f"expected a positive integer, got {short_repr(size)}")
        self._validate_tp_plan()
        from lightning_mm.core.cp_algorithms import ContextParallelError, canonical_algorithm

        try:
            self.context_parallel_algo = canonical_algorithm(self.context_parallel_algo)
        except ContextParallelError as err:
            raise self.key_error("context_parallel_algo", str(err).removeprefix("context_parallel_algo ")) from None

        if not isinstance(self.compile_backend, str) or not self.compile_backend.strip():
            raise self.key_error("compile_backend", f"expected a backend name, got {short_repr(self.compile_backend)}")
        if self.compile_modules:
            from lightning_mm.core.compile import check_backend

            try:
                check_backend(self.compile_backend)
            except ValueError as err:
                raise self.key_error("compile_backend", str(err)) from None

        if not isinstance(self.encoder_dp_balance, bool):
            raise self.key_error(
                "encoder_dp_balance", f"expected true or false, got {short_repr(self.encoder_dp_balance)}"
            )
        cost = self.encoder_dp_balance_cost
        if cost is not None:
            numbers = isinstance(cost, (list, tuple)) and len(cost) == 2
            numbers = numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cost)
            if not numbers or min(cost) < 0 or max(cost) <= 0:
                raise self.key_error(
                    "encoder_dp_balance_cost",
                    f"expected [linear, quadratic]: two non-negative numbers, not both 0, got {short_repr(cost)}",
                )
            self.encoder_dp_balance_cost = [float(v) for v in cost]
        steps = self.encoder_dp_balance_calibration_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise self.key_error(
                "encoder_dp_balance_calibration_steps", f"expected a positive integer, got {short_repr(steps)}"
            )

        if self.pin_memory and not self.offload_to_cpu:
            raise self.key_error("pin_memory", "only takes effect with `offload_to_cpu: true`; set both or remove it")

        # Imported here: the pattern grammar lives with the resolver, and a malformed pattern fails at load time.
        from lightning_mm.core.patterns import parse_pattern

        for key in _PATTERN_KEYS:
            for pattern in getattr(self, key):
                try:
                    parse_pattern(pattern)
                except ValueError as err:
                    raise self.key_error(key, str(err)) from None

    def _validate_tp_plan(self) -> None:
        plan = self.tp_plan
        if plan is None:
            return
        if not isinstance(plan, Mapping) or not all(isinstance(k, str) and k.strip() for k in plan):
            raise self.key_error("tp_plan", f"expected a mapping of module patterns to styles, got {short_repr(plan)}")
        for pattern, style in plan.items():
            if style not in TP_STYLES:
                raise self.key_error(
                    "tp_plan", f"'{pattern}': unknown style {short_repr(style)}; use one of {TP_STYLES}"
                )
        if self.tensor_parallel_size == 1:
            raise self.key_error("tp_plan", "only takes effect with `tensor_parallel_size` > 1; set both or remove it")
        self.tp_plan = {k.strip(): v for k, v in plan.items()}

    def check_expert_parallel_size(self, world_size: int) -> None:
        """``expert_parallel_size`` must divide the world size."""
        if world_size % self.expert_parallel_size != 0:
            raise self.key_error(
                "expert_parallel_size",
                f"{self.expert_parallel_size} does not divide the world size {world_size}",
            )

    def resolve_sharding_size(self, world_size: int) -> int:
        """The shard group size for ``world_size`` ranks; it must divide the world size."""
        size = world_size if self.sharding_size == "auto" else self.sharding_size
        if size > world_size or world_size % size != 0:
            raise self.key_error(
                "sharding_size", f"{size} does not divide the world size {world_size} (use 'auto' or a divisor)"
            )
        return size


TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "sequence_parallel")
"""The styles of Transformers' tensor-parallel plan notation that ``tp_plan`` takes (:mod:`~.tensor_parallel`)."""

_PATTERN_KEYS = ("sub_modules_to_wrap", "ignored_modules", "recompute_modules", "moe_modules", "compile_modules")

# Keys whose explicit ``null`` in YAML means "not set" and is kept as None.
_NULLABLE = {"param_dtype", "reduce_dtype", "output_dtype"}
