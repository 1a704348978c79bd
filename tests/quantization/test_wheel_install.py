"""The built wheel carries what the C kernels need: installed into a fresh virtualenv, kvfactory builds
and loads every kernel library from its own files (``kivi.c``, ``pages.c``, ``ragged.c`` and
``common.h``), not the torch fallback; ``kivi``, a minute's compile, is found in a cache seeded
with this environment's build under its sources' key. The new environment reaches torch and the
other dependencies through a ``.pth`` line naming the running environment's site-packages (nothing
is downloaded); a path line does not run that directory's ``.pth`` files, so the running
environment's editable kvfactory stays out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvfactory import kernels

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted(kernels.SIGNATURES)  # every C library the package declares: each ships and builds

# Run in the new environment: which kvfactory it imports, and the kernels' results against torch.
PROBE = """
import json, sys
import torch
import kvfactory
from kvfactory import kernels
from kvfactory.codecs import native
from kvfactory.codecs.kivi import KiviKeyCodec
from kvfactory.engine.weights import pack_weight
from kvfactory.selectors.pages import top_pages
from kvfactory.storage.ragged import paged_decode

codec = KiviKeyCodec(bits=4)
enc = codec.encode(torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0)))
query = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1))
t = enc.tensors
scores = native.key_scores(query, t["codes"], t["scale"], t["zero"], 4)
expected = query @ codec.decode(enc).transpose(-1, -2)
ranked = torch.tensor([[[0.5, 3.0, -1.0, 2.0, 1.0]]])
pool = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(2))
decode = [torch.randn(1, 4, 16), pool, pool.flip(1), torch.tensor([[2, 0]]), torch.tensor([1]),
          torch.tensor([6])]
decoded = paged_decode(*decode, 0.25) - paged_decode(*decode, 0.25, kernel=False)
torch.set_num_threads(1)  # the engine's setting, where its linear layers go in panels
weight, rows = torch.randn(64, 48), torch.randn(5, 48)
packed = pack_weight(weight)
print(json.dumps({
    "kvfactory": kvfactory.__file__, "torch": torch.__file__,
    "finders": [getattr(f, "__module__", "") for f in sys.meta_path],  # classes or instances
    "libraries": {name: kernels.load(name) is not None for name in kernels.SIGNATURES},
    "key_scores_error": (scores - expected).abs().max().item(),
    "top_pages": sorted(top_pages(ranked, 0, 5, 2).flatten().tolist()),
    "paged_decode_error": decoded.abs().max().item(),
    "panels": packed.panels == bool(kernels.load("linear").linear_has_body()),
    "linear_error": (packed.linear(rows, weight, None) - rows @ weight.T).abs().max().item(),
}))
"""


def _copy_project(dest: Path) -> Path:
    """The files a wheel is built from, copied so the build's egg-info and build/ stay out of the tree."""
    shutil.copytree(ROOT / "kvfactory", dest / "kvfactory", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_the_installed_wheel_builds_and_loads_the_c_kernels(tmp_path) -> None:
    if kernels.c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    project = _copy_project(tmp_path / "project")
    dist = tmp_path / "dist"
    subprocess.run([*pip, "wheel", str(project), "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(dist)], check=True, timeout=120)
    (wheel,) = dist.glob("kvfactory-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = ("__init__.py", *(f"{name}.c" for name in KERNELS), "common.h")
    assert {f"kvfactory/kernels/{f}" for f in sources} <= shipped

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=120)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shared = dict.fromkeys(sysconfig.get_path(p) for p in ("purelib", "platlib"))
    (site / "shared-environment.pth").write_text("".join(f"{p}\n" for p in shared))

    cache = tmp_path / "cache"
    # kivi.c takes a minute to compile: this environment's library goes in the new cache, where the
    # wheel finds it only if its kivi.c and headers are these, byte for byte (the cache key)
    seeded = kernels.build("kivi", kernels.c_compiler())
    (cache / "kvfactory" / "kernels").mkdir(parents=True)
    shutil.copy2(seeded, cache / "kvfactory" / "kernels" / seeded.name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVFACTORY_KERNEL_DIR")}
    env |= {"XDG_CACHE_HOME": str(cache), "PYTHONNOUSERSITE": "1"}
    run = subprocess.run([python, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout)

    assert Path(probe["kvfactory"]).is_relative_to(site)  # the wheel's copy, not a checkout's
    assert not any("editable" in finder for finder in probe["finders"])
    assert any(Path(probe["torch"]).is_relative_to(p) for p in shared)
    assert probe["libraries"] == dict.fromkeys(KERNELS, True), run.stderr  # the build's warning
    built = sorted(p.name for p in (cache / "kvfactory" / "kernels").glob("*.so"))
    assert [name.split("-")[0] for name in built] == KERNELS  # all but kivi compiled here,
    assert seeded.name in built  # from the installed sources; kivi found under the same sources' key
    assert probe["key_scores_error"] < 1e-4
    assert probe["top_pages"] == [1, 3]
    assert probe["paged_decode_error"] < 1e-5
    assert probe["panels"] and probe["linear_error"] < 1e-5
