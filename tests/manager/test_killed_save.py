"""A save SIGKILLed while it writes: the old file stays whole, and the next save of that path removes
what the killed one left (docs/manager.md, "Files: save and load")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny_models import tiny_config

from kvfactory.manager.persist import load_state, save_state
from kvfactory.manager.state import SequenceState

CACHE_CONFIG = {"type": "paged", "page_size": 4}
BIG_TOKENS = 2**16  # 32 MiB of K/V over 2 layers
# The saver stalls in the flush before its rename, so the kill always lands while the save is
# unfinished, however fast the disk takes the bytes (a kill racing a fast write found the save done).
SAVER = f"""
import os
import sys
import time
import torch
from tiny_models import tiny_config
from kvfactory.manager.persist import save_state
from kvfactory.manager.state import SequenceState

os.fsync = lambda fd: time.sleep(600)

tokens = int(sys.argv[2])
layers = [{{"keys": torch.ones(1, 2, tokens, 16), "values": torch.ones(1, 2, tokens, 16)}} for _ in range(2)]
state = SequenceState(layers, [tokens, tokens])
save_state(state, sys.argv[1], tiny_config("llama"), {CACHE_CONFIG!r}, "big")
"""


def state(tokens: int, seed: int) -> SequenceState:
    """Two layers of ``tokens`` random tokens (tiny llama: 2 KV heads of 16 dims)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [{name: torch.randn(1, 2, tokens, 16, generator=gen) for name in ("keys", "values")}
              for _ in range(2)]
    return SequenceState(layers, [tokens, tokens])


def growing_temporary(path: Path, writer: subprocess.Popen) -> Path:
    """The temporary ``writer`` saves ``path`` through, once it holds some bytes."""
    prefix = f".{path.name}.{writer.pid}."
    deadline = time.monotonic() + 120
    while writer.poll() is None and time.monotonic() < deadline:
        for entry in os.scandir(path.parent):
            if entry.name.startswith(prefix) and entry.stat().st_size > 0:
                return Path(entry.path)
        time.sleep(0.001)  # the write it waits for takes a large fraction of a second
    raise AssertionError(f"no growing temporary of {path.name}; the saver exited with {writer.returncode}: "
                         f"{writer.stderr.read().decode() if writer.returncode is not None else ''}")


def test_a_save_killed_while_writing_leaves_the_old_file_and_the_next_save_removes_its_temporary(
        tmp_path: Path) -> None:
    config, path = tiny_config("llama"), tmp_path / "a.safetensors"
    previous = state(8, seed=0)
    save_state(previous, path, config, CACHE_CONFIG, "a")
    before = path.read_bytes()
    tests = str(Path(__file__).resolve().parents[1])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
                        "OMP_NUM_THREADS": "1"}
    writer = subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(BIG_TOKENS)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        temporary = growing_temporary(path, writer)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()  # reaped: its pid names no running process
        writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL
    assert temporary.is_file() and temporary.name.endswith(".tmp")  # what the killed save left
    assert path.read_bytes() == before  # the old file, byte for byte, and it loads as saved
    assert all(torch.equal(tensor, previous.layers[int(name.split(".")[1])][name.split(".")[2]])
               for name, tensor in load_file(str(path)).items())
    after = state(5, seed=1)
    save_state(after, path, config, CACHE_CONFIG, "a")
    assert sorted(os.listdir(tmp_path)) == [path.name]
    loaded, seq_id = load_state(path, config, CACHE_CONFIG)
    assert seq_id == "a" and loaded.seen == after.seen
    assert all(torch.equal(loaded.layers[i][name], after.layers[i][name])
               for i in range(2) for name in ("keys", "values"))
