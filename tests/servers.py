"""``kvfactory serve`` as a real subprocess on 127.0.0.1, one per configuration a test module needs.

``ServerProcess`` starts ``python -m kvfactory.cli serve`` on a free port with one torch thread,
waits for ``/health``, and stops it with SIGTERM, returning the exit status and the log.
``stop_clean`` also checks what every server must end with: no sequence, no pool block held, exit
status 0 and the log line saying the pool is free.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import openai
import torch
from transformers import DynamicCache

from kvfactory.server.process import free_port, wait_healthy
from kvfactory.texts import shipped_text

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
START_TIMEOUT = 180.0  # seconds: loading torch and the model on a busy 2-core machine


class ServerProcess:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "kvfactory.cli", "serve", "--port", str(self.port), "--threads", "1",
                   *args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        wait_healthy(self.url, self.process, log_path, START_TIMEOUT)

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", **kwargs)

    def health(self) -> dict:
        return httpx2.get(f"{self.url}/health", timeout=30).json()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        text = httpx2.get(f"{self.url}/metrics", timeout=30).text
        selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
        pattern = re.escape(name + (f"{{{selector}}}" if selector else "")) + r" (\S+)"
        match = re.search(f"^{pattern}$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then the exit status and the log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return code, self.log()

    def stop_clean(self) -> None:
        health = self.health()
        assert (health["sequences"], health["blocks_held"]) == (0, 0), health
        code, log = self.stop()
        assert code == 0, log
        assert "the pool is free: 0 sequences, 0 blocks held" in log, log


def text_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` token-id prompts of ``tokens`` tokens from distinct parts of the shipped text."""
    ids = tokenizer(shipped_text(), add_special_tokens=False)["input_ids"]
    stride = tokens + 64
    assert len(ids) > 1000 + count * stride
    return [ids[1000 + i * stride:1000 + i * stride + tokens] for i in range(count)]


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """``model.generate`` with a ``DynamicCache``: the tokens a lossless server must answer with."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             past_key_values=DynamicCache())
    return out[0, len(prompt):].tolist()
