"""``FSDP2Config`` records the keys set explicitly; a model's defaults fill only the others (issue #11, point 6)."""

from __future__ import annotations

import copy
import pickle

from lightning_mm.core.config import FSDP2Config


class Adapted:
    """A model whose defaults ignore a tower and wrap its layers (as a frozen-tower VLM's do)."""

    def __init__(self) -> None:
        self.seen_explicit: dict | None = None

    def default_fsdp2_config(self, explicit: dict | None = None) -> dict:
        self.seen_explicit = explicit
        return {"sub_modules_to_wrap": ["layers.{*}"], "ignored_modules": ["tower"], "num_to_backward_prefetch": 2}


def test_yaml_keys_are_explicit_whatever_their_value(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text("sharding_size: auto\nignored_modules: []\nuse_reentrant: true\nrecompute_modules:\n")
    config = FSDP2Config.from_yaml(path)
    # `recompute_modules:` with no value means "not set", as documented.
    assert config.explicit_keys == {"sharding_size", "ignored_modules", "use_reentrant"}


def test_explicit_keys_win_even_when_they_equal_the_default():
    model = Adapted()
    config = FSDP2Config.from_dict({"ignored_modules": [], "num_to_backward_prefetch": 1}).with_model_defaults(model)
    assert config.ignored_modules == [] and config.num_to_backward_prefetch == 1
    assert config.sub_modules_to_wrap == ["layers.{*}"]
    assert model.seen_explicit == {"ignored_modules": [], "num_to_backward_prefetch": 1}
    # The model's defaults do not become the user's choice.
    assert config.explicit_keys == {"ignored_modules", "num_to_backward_prefetch"}


def test_keys_not_set_take_the_model_defaults():
    config = FSDP2Config(sharding_size="auto").with_model_defaults(Adapted())
    assert config.ignored_modules == ["tower"] and config.num_to_backward_prefetch == 2


def test_explicit_keys_survive_copies():
    config = FSDP2Config(2, ignored_modules=[])
    assert config.explicit_keys == {"sharding_size", "ignored_modules"}
    assert copy.deepcopy(config).explicit_keys == config.explicit_keys
    assert pickle.loads(pickle.dumps(config)).explicit_keys == config.explicit_keys
    assert config == FSDP2Config(sharding_size=2)  # equality compares values only
