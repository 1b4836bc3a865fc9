"""Hugging Face models inside a LightningModule: what a checkpoint records so that it converts to HF files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from lightning_mm._utils.modules import enclosing, transformers_class
from lightning_mm.errors import ConfigError

__all__ = ["hf_records", "choose_record", "lora_record"]


def _architecture(module: nn.Module) -> str:
    """The Hugging Face class a (possibly adapted or FSDP-wrapped) model is an instance of."""
    cls = transformers_class(type(module))
    return (cls or type(module)).__name__


def hf_records(root: nn.Module) -> list[dict[str, Any]]:
    """One record per top-most ``transformers.PreTrainedModel`` inside ``root``.

    Each holds the key ``prefix`` of the model in the LightningModule's state dict (``model.`` for an
    MMLightningModule), its ``architecture``, its ``config`` (JSON text) and ``pretrained``: the local directory
    it was loaded from (TransformersModel's ``init_from_hf_path``, as its config's ``name_or_path`` says), or
    ``None``; ``dcp-to-hf`` copies the tokenizer and processor files from there. Nothing is recorded (and
    transformers is not imported) when no transformers model is in use.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    base = transformers.PreTrainedModel
    records: list[dict[str, Any]] = []
    taken: list[str] = []
    for name, module in root.named_modules():
        if not isinstance(module, base) or enclosing(name, taken) is not None:
            continue
        prefix = f"{name}." if name else ""
        taken.append(name)
        architecture = _architecture(module)
        config = json.loads(module.config.to_json_string(use_diff=False))
        config["architectures"] = [architecture]
        record: dict[str, Any] = {
            "prefix": prefix,
            "architecture": architecture,
            "config": json.dumps(config),
            "pretrained": _pretrained_directory(module),
        }
        lora = lora_record(module)
        if lora is not None:
            record["lora"] = lora
        records.append(record)
    return records


def _pretrained_directory(module: nn.Module) -> str | None:
    """The local directory a model was loaded from (``from_pretrained`` sets its config's ``name_or_path``)."""
    name = getattr(module.config, "name_or_path", None)
    if not isinstance(name, str) or not name:
        return None
    path = Path(name)
    return str(path.resolve()) if path.is_dir() and (path / "config.json").is_file() else None


def lora_record(module: nn.Module) -> dict[str, Any] | None:
    """The PEFT ``LoraConfig`` of LoRA adapters added by ``lightning_mm.hf.lora`` (for ``dcp-to-hf
    --merge-lora``), as JSON-able data; ``None`` without adapters."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or "default" not in configs:
        return None
    data = configs["default"].to_dict()
    return json.loads(json.dumps(data, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def choose_record(records: list[dict[str, Any]], prefix: str | None, source: str) -> dict[str, Any]:
    """The record of ``prefix``, or the only one when ``prefix`` is None; a clear error otherwise."""
    if not records:
        raise ConfigError(
            f"{source} records no Hugging Face model: dcp-to-hf needs a checkpoint of a LightningModule whose model "
            "is a transformers PreTrainedModel (e.g. built with TransformersModel), or pass --config with the "
            "model's config.json"
        )
    if prefix is None:
        if len(records) > 1:
            raise ConfigError(
                f"{source} holds {len(records)} Hugging Face models; choose one with --prefix "
                f"({', '.join(r['prefix'] for r in records)})"
            )
        return records[0]
    for record in records:
        if record["prefix"] == prefix:
            return record
    raise ConfigError(
        f"{source} has no Hugging Face model at prefix {prefix!r} (recorded: {', '.join(r['prefix'] for r in records)})"
    )
