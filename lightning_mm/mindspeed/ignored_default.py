"""MindSpeed MM's ``ignored_modules`` default, written into every FSDP2 config ``migrate`` produces.

MindSpeed MM keeps out of FSDP only the modules its FSDP2 config lists, on each of its routes:

* the launch route (``--use-torch-fsdp2 --fsdp2-config-path fsdp2_config.yaml``, a model with FSDP2Mixin):
  ``initialize_fsdp2_config`` / ``get_ignored_params`` in ``mindspeed_mm/models/transformers/base_model.py`` read
  the YAML's ``ignored_modules`` (``None`` when unset: no parameter is ignored), and the model classes' own
  ``_fully_shard`` (Qwen3-VL's, GLM-4.5V's) shard their vision blocks whether or not ``freeze`` froze them;
* the native route (``parallel.fsdp_plan``): ``FSDPPlanConfig.ignored_modules`` defaults to ``[]``
  (``mindspeed_mm/fsdp/params/parallel_args.py``) and ``get_ignored_modules``
  (``mindspeed_mm/fsdp/distributed/fully_shard_parallel.py``) matches only those patterns.

This project's default plan (:func:`lightning_mm.hf.default_plans.derive_fsdp2_plan`) keeps a fully frozen vision
tower out of FSDP when the YAML leaves ``ignored_modules`` unset, so a migrated config states MindSpeed MM's
default, ``ignored_modules: []``, where the MindSpeed MM config leaves it unset (an empty value included: MindSpeed
MM reads it as none, this project as "unset"). The job then shards what MindSpeed MM shards.

Read, never imported: neither torch nor Transformers is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mm._utils.yaml_io import ConfigFileError, load_mapping

__all__ = ["WHY", "fsdp2_keys", "note_without_model", "states_ignored_modules", "with_ignored_default"]

WHY = (
    "MindSpeed MM ignores only the modules its FSDP2 config lists; lightning-mm's default would keep a fully "
    "frozen vision tower out of FSDP, which MindSpeed MM shards"
)
"""Why ``migrate`` writes ``ignored_modules: []``, as reports say it."""


def fsdp2_keys(fsdp2_config: Any) -> tuple[dict[str, Any] | None, str, str | None]:
    """The keys of a migrated strategy's ``fsdp2_config`` (inlined keys, or a YAML path read safely): (the keys, or
    None when there is no such file or it cannot be read; where they come from; the reading error, if any)."""
    if isinstance(fsdp2_config, Mapping):
        return dict(fsdp2_config), "fsdp2_config", None
    path = Path(str(fsdp2_config))
    if not path.is_file():
        return None, str(path), None
    try:
        return load_mapping(path), str(path), None
    except ConfigFileError as err:
        return None, str(path), str(err)


def states_ignored_modules(keys: Mapping[str, Any]) -> bool:
    """Whether an FSDP2 config's keys give ``ignored_modules`` a value (an empty YAML value does not)."""
    return keys.get("ignored_modules") is not None


def with_ignored_default(fsdp2_config: Any) -> tuple[Any, list[str], list[str]]:
    """A migrated strategy's ``fsdp2_config`` (a YAML path or inlined keys) with MindSpeed MM's ``ignored_modules``
    default stated: (the value to write, mapped lines, not-mapped lines). A YAML that leaves ``ignored_modules``
    unset is never edited: its keys are written inline with ``ignored_modules: []`` added. A path that is not a file
    (yet) is kept, with a line saying what to write in it."""
    if fsdp2_config is None:
        return None, [], []
    keys, where, error = fsdp2_keys(fsdp2_config)
    if keys is None:
        return (
            fsdp2_config,
            [],
            [error or f"{where}: write `ignored_modules: []` in it unless it lists modules ({WHY})"],
        )
    if states_ignored_modules(keys):
        return fsdp2_config, [], []
    keys["ignored_modules"] = []
    inline = "" if isinstance(fsdp2_config, Mapping) else " (its keys written inline; the file is unchanged)"
    line = f"{where} ignored_modules: not set -> trainer.strategy.init_args.fsdp2_config.ignored_modules: []{inline}"
    return keys, [f"{line} ({WHY})"], []


def note_without_model(fsdp2_config: Any) -> str | None:
    """The note for a migration that maps no Transformers model (an FSDP2 YAML given by itself, a launch without a
    model config): the YAML is kept as written, and what to add where it is paired with a Transformers model whose
    tower is frozen. None when the YAML states ``ignored_modules`` or cannot be read (other lines name it)."""
    if fsdp2_config is None or isinstance(fsdp2_config, Mapping):
        keys: Mapping[str, Any] | None = fsdp2_config
        where = "fsdp2_config"
    else:
        path = Path(str(fsdp2_config))
        try:
            keys = load_mapping(path) if path.is_file() else None
        except ConfigFileError:
            keys = None
        where = str(path)
    if keys is None or states_ignored_modules(keys):
        return None
    return (
        f"{where} sets no ignored_modules: kept as written; with a Transformers model whose vision tower is frozen, "
        f"add `ignored_modules: []` to it ({WHY})"
    )
