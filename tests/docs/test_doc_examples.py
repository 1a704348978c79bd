"""Every Python block of README.md and docs/*.md, executed on the embedded model with no network.

A block runs in a namespace holding only the placeholders it names (``model``, ``tokenizer``,
``prompt``, ``inputs``, ``prompts``, ...; see ``PLACEHOLDERS``), in a temporary working directory
that holds the files the docs refer to (``kv_scales.safetensors``, ``my_profile.json``); addresses
(the server's, Redis's, a disk tier's folder) are replaced by live ones. A block of bare config
dicts builds a cache from each and generates with it; a block that defines ``config`` does the same
with it. Blocks whose documented claims are checkable (the README's first block, sparse decode, the
manager) are checked in ``CHECKS``. A new block that names a placeholder this module does not fill
fails here with a ``NameError``, so an example can never go stale unnoticed.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from servers import ServerProcess

from kvfactory import KVCacheFactory, config, eviction, selectors
from kvfactory.eval.data import passkey_prompts
from kvfactory.texts import shipped_text

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SERVER_URL = "http://127.0.0.1:8000"
REDIS_URL = "redis://127.0.0.1:6379/0"
DISK_FOLDER = "/var/cache/kv"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    section: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The fenced ``python`` blocks of a Markdown page, each with its line and section heading."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        before = text[:match.start()]
        headings = re.findall(r"^#+ (.+)$", before, re.MULTILINE)
        blocks.append(Block(path.relative_to(REPO).as_posix(), before.count("\n") + 1,
                            headings[-1] if headings else "", match.group(1)))
    return blocks


def distinct(blocks: list[Block]) -> list[Block]:
    """Each code once: a block shown on two pages (the manager's, in README.md and docs/manager.md)
    runs where it first appears."""
    first: dict[str, Block] = {}
    for block in blocks:
        first.setdefault(block.code, block)
    return list(first.values())


BLOCKS = distinct([block for page in PAGES for block in python_blocks(page)])


def test_the_pages_have_python_blocks_and_each_compiles() -> None:
    pages = {block.page for block in BLOCKS}
    assert len(BLOCKS) >= 20 and {"README.md", "docs/storage.md", "docs/serving.md"} <= pages
    for block in BLOCKS:
        compile(block.code, str(block), "exec")
    assert set(CHECKS) <= {(block.page, block.section) for block in BLOCKS}, "a checked block was renamed"


# -- placeholders ----------------------------------------------------------------------------------------

def names_read(code: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name)}


def passkey_text(tokenizer: Any, tokens: int) -> Any:
    return passkey_prompts(tokenizer, tokens, [0.5], keys_per_depth=1)[0]


def shared_prefix_prompts(tokenizer: Any) -> list[torch.Tensor]:
    """Three chats that begin with the same 64-token system prompt, each ``[1, tokens]``."""
    system = tokenizer(shipped_text(), add_special_tokens=False).input_ids[:64]
    questions = ("Who is Alice?", "Where is the rabbit going?", "What is the Queen like?")
    return [torch.tensor([system + tokenizer(f" {question}", add_special_tokens=False).input_ids])
            for question in questions]


def ragged_inputs() -> dict[str, Any]:
    """Two sequences over one layer's 16-token blocks: what ``paged_decode`` takes."""
    generator = torch.Generator().manual_seed(0)
    blocks = SimpleNamespace(k=torch.randn(3, 8, 16, 64, generator=generator),
                             v=torch.randn(3, 8, 16, 64, generator=generator))
    return {"query": torch.randn(2, 9, 64, generator=generator), "blocks": blocks,
            "tables": torch.tensor([[0, 3, 5], [1, 2, 0]]), "starts": torch.tensor([0, 4]),
            "lengths": torch.tensor([40, 20]), "scale": 64 ** -0.5}


def oval_cache(model: Any) -> Any:
    return KVCacheFactory(model.config, {"type": "composite", "strategies": [
        {"name": "paged", "page_size": 16}, {"name": "oval", "read_budget": 0.125}]}).create_cache()


def tier_chunks() -> dict[str, Any]:
    """A 512-token prompt's two computed chunks, ``[layers, kv_heads, 256, head_dim]`` each."""
    generator = torch.Generator().manual_seed(1)
    return {"prompt_ids": list(range(1000, 1512)),
            "computed_chunks": [(torch.randn(30, 3, 256, 64, generator=generator),
                                 torch.randn(30, 3, 256, 64, generator=generator)) for _ in range(2)]}


PLACEHOLDERS: dict[str, Callable[[Any, Any], dict[str, Any]]] = {
    "model": lambda model, tokenizer: {"model": model},
    "tokenizer": lambda model, tokenizer: {"tokenizer": tokenizer},
    "NAME": lambda model, tokenizer: {"NAME": str(__import__("kvfactory.models").models._cache_dir())},
    "prompt": lambda model, tokenizer: {"prompt": passkey_text(tokenizer, 1024).prompt},
    "inputs": lambda model, tokenizer: {"inputs": tokenizer(passkey_text(tokenizer, 256).prompt,
                                                            return_tensors="pt")},
    "prompts": lambda model, tokenizer: {"prompts": shared_prefix_prompts(tokenizer)},
    "query": lambda model, tokenizer: ragged_inputs(),
    "cache": lambda model, tokenizer: {"cache": oval_cache(model)},
    "k": lambda model, tokenizer: {"k": torch.randn(1, 3, 20, 64), "v": torch.randn(1, 3, 20, 64)},
    "computed_chunks": lambda model, tokenizer: tier_chunks(),
}


# -- checks of what a block claims ------------------------------------------------------------------------

def check_use_it(code: str, namespace: dict[str, Any], printed: str, workdir: Path) -> None:
    """It answers the question about its prompt, prints a readable report and int4's bytes (< 1/2)."""
    assert "actor" in printed.splitlines()[0], printed
    assert "KV cache: " in printed and "bytes per token" in printed and "nan" not in printed
    ratio = re.fullmatch(r"(\d\.\d\d)x DynamicCache's bytes", printed.strip().splitlines()[-1])
    assert ratio is not None and float(ratio[1]) < 0.5, printed


def check_sparse_decode(code: str, namespace: dict[str, Any], printed: str, workdir: Path) -> None:
    """Quest reads about 1/8 of the pages (plus the always-read ones) and still finds the passkey; the
    example turns sparse decode on in at most 15 lines."""
    assert len([line for line in code.splitlines() if line.strip()]) <= 15
    metrics = namespace["cache"].routing_metrics()
    assert metrics["steps"] == 63 and metrics["read_fraction"] < 0.35, metrics
    answer = namespace["tokenizer"].decode(namespace["out"][0, namespace["inputs"]["input_ids"].shape[1]:])
    assert passkey_text(namespace["tokenizer"], 1024).answer in answer


def check_manager(code: str, namespace: dict[str, Any], printed: str, workdir: Path) -> None:
    """Users 1 and 2 reuse the system prompt's 4 whole blocks; the files and forks are there."""
    manager = namespace["manager"]
    assert [manager.cached_tokens(f"user{i}") for i in (1, 2)] == [64, 64]
    assert manager.stats()["prefix_hit_blocks"] == 8 and (workdir / "user1.safetensors").is_file()
    assert sorted(manager.sequences()) == ["copy", "user1", "user1-b", "user2"]


CHECKS = {
    ("README.md", "Use it"): check_use_it,
    ("README.md", "Sparse decode: read only the pages a step needs (Quest, OVAL)"): check_sparse_decode,
    ("README.md", "Many sequences over one pool: `KVCacheManager`"): check_manager,
}


# -- running a block --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    """``kvfactory serve`` for the OpenAI client example, started only if a block needs it."""
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log", "--pool-tokens", "4096")
    yield server
    server.stop_clean()


@pytest.fixture
def registries():
    """Blocks register their own strategy, policy or selector; every registry is as it was after."""
    saved = [(registry, dict(registry))
             for registry in (config._REGISTRY, eviction.POLICIES, selectors.SELECTORS)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.fixture(scope="module")
def doc_files(tmp_path_factory, smollm2) -> Path:
    """The files the docs name: static scales (calibrated once) and a read-budget profile."""
    from kvfactory.codecs import calibration

    model, tokenizer = smollm2
    folder = tmp_path_factory.mktemp("doc_files")
    ids = tokenizer(shipped_text()[:4000], return_tensors="pt", add_special_tokens=False).input_ids[:, :256]
    scales = calibration.collect(model, ids)
    calibration.save(scales, folder / "kv_scales.safetensors", {"model": "smollm2"})
    shutil.copy(REPO / "kvfactory" / "selectors" / "smollm2_layer_budgets.json", folder / "my_profile.json")
    return folder


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch, doc_files: Path) -> Path:
    """A fresh working directory holding the files the docs name."""
    for name in ("kv_scales.safetensors", "my_profile.json"):
        shutil.copy(doc_files / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def live_code(block: Block, request: pytest.FixtureRequest, workdir: Path) -> str:
    """The block's text with its addresses replaced by live ones."""
    code = block.code
    if SERVER_URL in code:
        code = code.replace(SERVER_URL, request.getfixturevalue("server").url)
    if REDIS_URL in code:
        code = code.replace(REDIS_URL, request.getfixturevalue("redis_url"))
    return code.replace(DISK_FOLDER, str(workdir / "disk-tier"))


def config_dicts(code: str, namespace: dict[str, Any]) -> list[dict]:
    """The configs a block shows: its bare dict expressions (a composite entry gets paged storage
    before it), or the ``config`` it defines."""
    tree = ast.parse(code)
    if all(isinstance(statement, ast.Expr) for statement in tree.body):
        values = [eval(compile(ast.Expression(s.value), "<block>", "eval"), {}) for s in tree.body]  # noqa: S307
        assert all(isinstance(value, dict) for value in values), values
        return [value if "type" in value or value.get("name") == "paged"
                else {"type": "composite", "strategies": [{"name": "paged", "page_size": 16}, value]}
                for value in values]
    return [namespace["config"]] if isinstance(namespace.get("config"), dict) else []


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_the_block_runs_as_written(block: Block, smollm2, workdir: Path, registries, request, capsys) -> None:
    model, tokenizer = smollm2
    code = live_code(block, request, workdir)
    namespace: dict[str, Any] = {}
    for name in names_read(code) & PLACEHOLDERS.keys():
        namespace.update(PLACEHOLDERS[name](model, tokenizer))
    exec(compile(code, str(block), "exec"), namespace)  # noqa: S102 - the documented example itself
    printed = capsys.readouterr().out
    ids = tokenizer(shipped_text()[:2000], return_tensors="pt").input_ids[:, :300]
    for cache_config in config_dicts(code, namespace):
        cache = KVCacheFactory(model.config, cache_config).create_cache()
        out = model.generate(ids, cache=cache, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert out.shape == (1, 303) and cache.get_seq_length() == 302, cache_config
    check = CHECKS.get((block.page, block.section))
    if check is not None:
        check(code, namespace, printed, workdir)
