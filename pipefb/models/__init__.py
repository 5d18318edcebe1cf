"""Model registry: builds a model's layer sequence by name, deterministically from a seed.

Built-in models come first; user models are found through the entry-point group
`pipefb.models`, whose entry points load a callable `config: dict -> list[nn.Module]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipefb.configparse import parse_config
from pipefb.errors import ConfigError
from pipefb.models import convnet, gpt, mlp
from pipefb.plugins import find_builder, plugin_names

Builder = Callable[[dict[str, Any]], list[nn.Module]]

ENTRY_POINT_GROUP = "pipefb.models"
_BUILTINS: dict[str, Builder] = {"mlp": mlp.build, "gpt": gpt.build, "convnet": convnet.build}
MODELS: tuple[str, ...] = tuple(_BUILTINS)


def build_model(name: str, config: dict[str, Any] | None = None, seed: int = 0) -> list[nn.Module]:
    """Builds the layer sequence of model `name`; the same arguments give identical weights.

    The global RNG is forked, so the caller's RNG state is untouched.

    Args:
        name: a built-in name (`MODELS`) or an entry point of group `pipefb.models`.
        config: JSON-able overrides of the model's config defaults.
        seed: the initialisation seed.

    Returns:
        The layers, each mapping one tensor to one tensor (the loss is appended later).

    Raises:
        ConfigError: an unknown name, a bad config, or a plugin that fails to load or
            returns something other than a list of modules.
    """
    builder: Builder = find_builder("model", name, _BUILTINS, ENTRY_POINT_GROUP,
                                    sorted(known_models()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            layers = builder(dict(config or {}))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"model {name!r} failed to build: {exc!r}") from exc
    return _check_layers(name, layers)


def _check_layers(name: str, layers: object) -> list[nn.Module]:
    if not isinstance(layers, list) or not layers:
        raise ConfigError(f"model {name!r} returned {type(layers).__name__}, not a list of modules")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"model {name!r} layer {i} is a {type(layer).__name__}, not a Module")
    return layers


def sequence_sizes(name: str, config: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(block_size, vocab_size) of a model that reads token sequences, from its config:
    the window a token dataset cuts and the ids its samples may hold. (None, None) for
    models without them (plugins too: a token dataset then takes its own block_size).

    Raises:
        ConfigError: a bad config of such a model.
    """
    if name == "gpt":
        cfg = parse_config(gpt.GPTConfig, dict(config or {}), "model 'gpt'")
        return cfg.block_size, cfg.vocab_size
    return None, None


def known_models() -> tuple[str, ...]:
    """Returns the built-in model names followed by the installed plugin names."""
    return MODELS + tuple(plugin_names(ENTRY_POINT_GROUP, _BUILTINS))


__all__ = ["ENTRY_POINT_GROUP", "MODELS", "Builder", "build_model", "known_models",
           "sequence_sizes"]
