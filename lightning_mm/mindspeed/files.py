"""Reading MindSpeed MM's files: YAML with the project's safe loader, JSON as JSON, errors naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_mm._utils.yaml_io import load_mapping
from lightning_mm.mindspeed.keys import MindSpeedConfigError
from lightning_mm.mindspeed.launch_script import read_text_file

__all__ = ["load_yaml", "load_config_file"]


def load_yaml(path: Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (the project's bounded safe loader)."""
    return load_mapping(path, MindSpeedConfigError)


def load_config_file(path: Path) -> dict[str, Any]:
    """A YAML or JSON config (JSON read as JSON: YAML refuses the tabs JSON allows)."""
    if path.suffix.lower() != ".json":
        try:
            return load_yaml(path)
        except MindSpeedConfigError as err:
            if "not valid YAML" not in str(err):
                raise
            from lightning_mm.mindspeed.refusals import Refused

            raise Refused(str(path), "invalid", str(err)) from None
    try:
        data = json.loads(read_text_file(path, "a JSON config"))
    except ValueError as err:
        raise MindSpeedConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        from lightning_mm.mindspeed.launch_kinds import refuse_list

        refuse_list(data, str(path))
        raise MindSpeedConfigError(
            f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data
