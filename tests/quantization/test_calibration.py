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


# -- calibrate: true: the same static scales, fixed by the first prefill -------------------------------

@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_the_first_512_tokens_fix_the_scales_every_cache_of_the_factory_uses(codec: str) -> None:
    """A short prompt stays in full precision; the first cache to hold ``FIRST_USE_TOKENS`` tokens
    fixes each layer's scales to their |K| and |V| maxima per head, as ``collect`` measures on them
    (exactly in layer 0; later layers see K/V computed through the quantized layers before them),
    and every cache of the factory encodes with them from then on, codes only."""
    model = tiny_model("llama")
    factory = KVCacheFactory(model.config, {"type": "paged", "page_size": 8,
                                            "quantization": {"codec": codec, "calibrate": True}})
    short, long = factory.create_cache(), factory.create_cache()
    with torch.no_grad():
        model(random_prompt(40), past_key_values=short)
    assert not factory.first_use.fixed()
    assert all(layer.store.inner.size() == 40 and layer.store.quantized_tokens == 0 for layer in short.layers)
    prompt = random_prompt(calibration.FIRST_USE_TOKENS, seed=3)
    with torch.no_grad():
        model(prompt, past_key_values=long)
    assert factory.first_use.fixed()
    expected = calibration.collect(model, prompt)
    limit = STATIC_LIMITS[codec]
    for layer in range(model.config.num_hidden_layers):
        rtol = 1e-5 if layer == 0 else 0.02
        for cache in (short, long):
            store = cache.layers[layer].store
            pairs = ((store.key_codec, calibration.KEYS), (store.value_codec, calibration.VALUES))
            for codec_of, name in pairs:
                assert torch.allclose(codec_of.static_scale, expected[name][layer] / limit, rtol=rtol)
    with torch.no_grad():
        model(random_prompt(1, seed=4), past_key_values=short)
    assert short.layers[0].store.quantized_tokens == 41  # its held tokens, encoded with the fixed scales
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert long.layers[0].store.key_codec.bytes_per_token(heads, dim) == heads * dim


def test_a_layout_probe_of_zeros_does_not_fix_a_scale() -> None:
    cell = calibration.FirstUseScale(heads=2, limit=127.0)
    cell.fix(torch.zeros(1, 2, 16, 4))
    assert not cell.fixed and torch.equal(cell.scale, torch.ones(2))
    x = torch.tensor([1.0, -254.0]).view(1, 2, 1, 1).expand(1, 2, 3, 4)
    cell.fix(x)
    assert cell.fixed and torch.allclose(cell.scale, torch.tensor([1 / 127, 2.0]))


def test_calibrate_is_refused_where_it_cannot_apply(tmp_path, scales_file) -> None:
    path, _ = scales_file
    config = tiny_config("llama")
    for quantization, match in [({"codec": "int4", "calibrate": True}, "calibrate.*not \\['int4'\\]"),
                                ({"codec": "int8", "calibrate": True, "scales": str(path)}, "not both"),
                                ({"codec": "int8", "calibrate": "yes"}, "calibrate.*true or false")]:
        with pytest.raises(ConfigError, match=match):
            KVCacheFactory(config, {"type": "paged", "quantization": quantization})


def test_a_manager_shares_calibrated_prefixes_and_keeps_their_sequences_in_memory(tmp_path) -> None:
    """Prefix blocks encoded with the factory's scales decode alike for every sequence; a file could
    not carry those scales, so save and load refuse and write nothing."""
    from kvfactory import KVCacheManager, UnsupportedError

    model = tiny_model("llama")
    manager = KVCacheManager(model.config, {"type": "paged", "page_size": 4, "pool_tokens": 4096,
                                            "quantization": {"codec": "int8", "calibrate": True}})
    prompt = random_prompt(calibration.FIRST_USE_TOKENS + 24)
    outputs = []
    for seq_id in ("a", "b"):
        cache = manager.create(seq_id, prompt=prompt[0])
        with torch.no_grad():
            out = model.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False)
        outputs.append(out)
    assert manager.cached_tokens("b") > 0 and torch.equal(outputs[0], outputs[1])
    with pytest.raises(UnsupportedError, match="calibrate: true"):
        manager.save("a", tmp_path / "a.safetensors")
    assert not list(tmp_path.iterdir())
