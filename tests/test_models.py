"""pipefb.models: built-ins build deterministically, run, reject bad configs; plugins load."""

from __future__ import annotations

import importlib
import math
import sys
import textwrap

import pytest
import torch
from torch import nn

from pipefb.errors import ConfigError
from pipefb.models import MODELS, build_model, known_models

TINY = {
    "mlp": {"in_features": 8, "hidden": 16, "depth": 2, "out_features": 3},
    "gpt": {"vocab_size": 50, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16},
    "convnet": {"channels1": 4, "channels2": 8, "hidden": 12, "classes": 5},
}
INPUTS = {
    "mlp": lambda: torch.randn(4, 8),
    "gpt": lambda: torch.randint(50, (4, 8)),
    "convnet": lambda: torch.rand(4, 64),
}
SHAPES = {
    "mlp": [(4, 16), (4, 16), (4, 3)],
    "gpt": [(4, 8, 16), (4, 8, 16), (4, 8, 16), (4, 8, 50)],
    "convnet": [(4, 4, 8, 8), (4, 8, 4, 4), (4, 12), (4, 5)],
}


def flat_params(layers: list[nn.Module]) -> list[torch.Tensor]:
    return [p for layer in layers for p in layer.parameters()]


def test_registry_names() -> None:
    assert MODELS == ("mlp", "gpt", "convnet")
    assert known_models()[:3] == MODELS


@pytest.mark.parametrize("name", MODELS)
def test_forward_shapes_through_layer_sequence(name: str) -> None:
    x = INPUTS[name]()
    for layer, shape in zip(build_model(name, TINY[name]), SHAPES[name], strict=True):
        x = layer(x)
        assert tuple(x.shape) == shape


@pytest.mark.parametrize("name", MODELS)
def test_default_config_builds_and_runs(name: str) -> None:
    layers = build_model(name)
    x = torch.randint(256, (2, 32)) if name == "gpt" else torch.rand(2, 64)
    for layer in layers:
        x = layer(x)
    assert x.shape[-1] == (256 if name == "gpt" else 10)


@pytest.mark.parametrize("name", MODELS)
def test_deterministic_in_seed_and_leaves_caller_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = flat_params(build_model(name, TINY[name], seed=7))
    assert torch.equal(torch.random.get_rng_state(), before)
    b = flat_params(build_model(name, TINY[name], seed=7))
    c = flat_params(build_model(name, TINY[name], seed=8))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_gpt_init_and_layout() -> None:
    layers = build_model("gpt", {"n_layer": 4, "n_embd": 64, "n_head": 4})
    assert [type(layer).__name__ for layer in layers] == ["Embedding"] + ["Block"] * 4 + ["Head"]
    block = layers[1]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert abs(block.mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(8)) < 0.001
    assert torch.count_nonzero(block.attn.c_attn.bias) == 0
    assert "mask" not in block.state_dict()  # non-persistent buffer
    assert not any(n.endswith("mask") for n, _ in layers[-1].named_buffers())


def test_gpt_is_causal() -> None:
    layers = build_model("gpt", TINY["gpt"])
    x = torch.randint(50, (1, 8))
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 50

    def run(idx: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            idx = layer(idx)
        return idx

    out_x, out_y = run(x), run(y)
    torch.testing.assert_close(out_x[:, :5], out_y[:, :5])
    assert not torch.allclose(out_x[:, 5:], out_y[:, 5:])


def test_gpt_rejects_too_long_sequence() -> None:
    with pytest.raises(ValueError, match="block_size 8"):
        build_model("gpt", TINY["gpt"])[0](torch.zeros(1, 9, dtype=torch.long))


def test_convnet_has_no_buffers() -> None:
    assert not [b for layer in build_model("convnet") for b in layer.buffers()]


@pytest.mark.parametrize(
    ("name", "config", "needle"),
    [
        ("mlp", {"width": 3}, "'width'.*'mlp'"),
        ("gpt", {"n_embed": 3}, "'n_embed'.*'gpt'"),
        ("convnet", {"channels": 3}, "'channels'.*'convnet'"),
        ("gpt", {"n_embd": 30, "n_head": 4}, "n_embd = 30"),
        ("gpt", {"dropout": 1.5}, "dropout = 1.5"),
        ("gpt", {"bias": 1}, "'bias'"),
        ("mlp", {"hidden": -4}, "hidden = -4"),
        ("mlp", {"depth": 2.5}, "'depth'"),
        ("mlp", {"in_features": True}, "'in_features'"),
        ("convnet", {"classes": 0}, "classes = 0"),
        ("convnet", {"image_size": "8"}, "'image_size'"),
    ],
)
def test_config_errors_name_the_key(name: str, config: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_model(name, config)


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ConfigError, match=r"'resnet'.*'convnet'.*'gpt'.*'mlp'"):
        build_model("resnet")


PLUGIN = """
import torch
from torch import nn


def build(config):
    width = config.get("width", 4)
    return [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)]


def not_a_list(config):
    return nn.Linear(2, 2)


def not_modules(config):
    return [nn.Linear(2, 2), "relu"]


def raises(config):
    raise RuntimeError("plugin exploded")


NOT_CALLABLE = 3
"""

ENTRY_POINTS = """\
[pipefb.models]
tiny_plugin = pipefb_test_plugin:build
plugin_not_a_list = pipefb_test_plugin:not_a_list
plugin_not_modules = pipefb_test_plugin:not_modules
plugin_raises = pipefb_test_plugin:raises
plugin_missing_attr = pipefb_test_plugin:nowhere
plugin_missing_module = pipefb_no_such_module:build
plugin_not_callable = pipefb_test_plugin:NOT_CALLABLE
mlp = pipefb_test_plugin:build
"""


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    (tmp_path / "pipefb_test_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "pipefb_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pipefb-test-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop("pipefb_test_plugin", None)


def test_entry_point_plugin_builds_deterministically(plugin_path) -> None:
    assert "tiny_plugin" in known_models()
    a = build_model("tiny_plugin", {"width": 6}, seed=3)
    b = build_model("tiny_plugin", {"width": 6}, seed=3)
    assert [type(m).__name__ for m in a] == ["Linear", "Tanh", "Linear"]
    assert a[0].weight.shape == (6, 6)
    assert all(torch.equal(x, y) for x, y in zip(flat_params(a), flat_params(b), strict=True))


def test_builtins_shadow_plugins(plugin_path) -> None:
    assert isinstance(build_model("mlp")[0], nn.Sequential)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("plugin_not_a_list", "'plugin_not_a_list' returned Linear"),
        ("plugin_not_modules", "'plugin_not_modules' layer 1 is a str"),
        ("plugin_raises", "'plugin_raises' failed to build.*plugin exploded"),
        ("plugin_missing_attr", "'plugin_missing_attr'.*failed to load"),
        ("plugin_missing_module", "'plugin_missing_module'.*failed to load"),
        ("plugin_not_callable", "'plugin_not_callable'.*not callable"),
    ],
)
def test_bad_plugins_raise_config_error(plugin_path, name: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_model(name)


@pytest.mark.parametrize("name", MODELS)
def test_layers_trace_under_aot_autograd(name: str) -> None:
    from functorch.compile import aot_function, make_boxed_func
    from torch.func import functional_call

    x = INPUTS[name]()
    for layer in build_model(name, TINY[name]):
        graphs = []

        def capture(gm, _inputs, graphs=graphs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        def run(params, buffers, inp, layer=layer):
            return functional_call(layer, {**params, **buffers}, (inp,))

        traced = aot_function(run, fw_compiler=capture, bw_compiler=capture)
        params = dict(layer.named_parameters())
        inp = x.detach().requires_grad_(x.is_floating_point())
        out = traced(params, dict(layer.named_buffers()), inp)
        out.sum().backward()
        torch.testing.assert_close(out, layer(x))
        assert len(graphs) == 2  # forward and backward graphs were captured
        x = out.detach()
