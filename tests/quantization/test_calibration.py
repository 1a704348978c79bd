"""Calibration: K/V magnitudes collected on text, saved atomically, loaded as static codec scales."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, tiny_config, tiny_model
from typer.testing import CliRunner

from kvfactory import ConfigError, KVCacheFactory
from kvfactory.cli import app
from kvfactory.codecs import calibration
from kvfactory.codecs.spec import STATIC_LIMITS
from kvfactory.texts import shipped_text


@pytest.fixture
def scales_file(tmp_path):
    model = tiny_model("llama")
    scales = calibration.collect(model, random_prompt(48))
    return calibration.save(scales, tmp_path / "scales.safetensors", {"model": "tiny llama"}), scales


def test_collect_holds_the_largest_magnitudes_per_layer_and_head(scales_file) -> None:
    path, scales = scales_file
    config = tiny_config("llama")
    assert scales[calibration.KEYS].shape == (config.num_hidden_layers, config.num_key_value_heads)
    loaded = calibration.load(str(path))
    assert all(torch.equal(loaded[k], scales[k]) for k in scales)
    assert not list(path.parent.glob(".*tmp*"))  # the temp file is gone


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_static_scales_store_codes_only(scales_file, codec: str) -> None:
    path, scales = scales_file
    model = tiny_model("llama")
    config = {"type": "dense", "quantization": {"codec": codec, "scales": str(path)}}
    cache = KVCacheFactory(model.config, config).create_cache()
    store = cache.layers[1].store
    limit = STATIC_LIMITS[codec]
    assert torch.allclose(store.key_codec.static_scale, scales[calibration.KEYS][1] / limit)
    assert torch.allclose(store.value_codec.static_scale, scales[calibration.VALUES][1] / limit)
    with torch.no_grad():
        model(random_prompt(40), past_key_values=cache)
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert store.key_codec.bytes_per_token(heads, dim) == heads * dim  # no per-token scale bytes


def test_bad_calibration_files(tmp_path, scales_file) -> None:
    path, scales = scales_file
    config = tiny_config("llama")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    for file in (bad, tmp_path / "missing.safetensors"):
        with pytest.raises(ConfigError, match="calibration file"):
            KVCacheFactory(config, {"type": "dense", "quantization": {"codec": "fp8", "scales": str(file)}})
    with pytest.raises(ConfigError, match="not \\['int4'\\]"):
        KVCacheFactory(config, {"type": "dense", "quantization": {"codec": "int4", "scales": str(path)}})
    deeper = tiny_config("llama", num_hidden_layers=4)
    with pytest.raises(ConfigError, match="model of 4 layers; the file holds 2"):
        KVCacheFactory(deeper, {"type": "dense", "quantization": {"codec": "fp8", "scales": str(path)}}
                       ).create_cache()


@pytest.mark.slow
def test_calibrate_command_on_the_embedded_model(tmp_path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(shipped_text()[:5000])
    out = tmp_path / "scales.safetensors"
    result = CliRunner().invoke(app, ["calibrate", "--text", str(text), "--out", str(out), "--tokens", "64"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    scales = calibration.load(str(out))
    assert scales[calibration.KEYS].shape == (30, 3)
    assert "30 layers x 3 KV heads over 64 tokens" in " ".join(result.output.split())
    missing = str(tmp_path / "none.txt")
    result = CliRunner().invoke(app, ["calibrate", "--text", missing], env={"COLUMNS": "300"})
    assert result.exit_code != 0 and "cannot read it" in " ".join(result.output.split())
