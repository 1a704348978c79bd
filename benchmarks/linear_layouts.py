"""A step's linear layers: the model's row-major weights (MKL's GEMM), oneDNN's reordered ones, and
kvfactory's panels (``kernels/linear.c``).

Every ``nn.Linear`` of SmolLM2 (30 layers of q, k, v, o, gate, up, down, then the 49,152-token
``lm_head``), each with its own weights so they stream from memory as in a real step, multiplied by
``rows`` rows (a decode step's sequences, or a prefill chunk's tokens): the model's own ``F.linear``,
``kvfactory.engine.weights.packed_linear`` (oneDNN) and ``panel_linear`` (panels, where this CPU has
the kernel's AVX-512 body; the engine runs them on one thread). Reports milliseconds, the weights'
read rate, the arithmetic rate and each layout's speed-up over the model's, per row count, on one
thread; the median of ``--runs``; prints JSON with the CPU model.

    python benchmarks/linear_layouts.py [--rows 1,4,8,16,32,64,512] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvfactory.engine import weights as layouts
from kvfactory.measure import cpu_model
from kvfactory.models import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,512")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not layouts.packing_available():
        raise SystemExit("this torch has no oneDNN linear ops")
    config = load_config("smollm2")
    hidden, inter, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    kv = config.num_key_value_heads * hidden // heads
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden),
              (inter, hidden), (hidden, inter)] * config.num_hidden_layers + [(config.vocab_size, hidden)]
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) * inp ** -0.5 for out, inp in shapes]
    packed = [layouts.pack(w) for w in weights]
    fit = all(layouts.panels_fit(w) for w in weights)
    panels = [layouts.pack_panels(w) for w in weights] if fit else None
    total = sum(w.nbytes for w in weights)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {inp: torch.randn(rows, inp) for _, inp in shapes}

        def model_path(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def packed_path(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w, p in zip(weights, packed, strict=True):
                layouts.packed_linear(inputs[w.shape[1]], p, None)

        def panel_path(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for w, p in zip(weights, panels, strict=True):
                layouts.panel_linear(inputs[w.shape[1]], p, None)

        times = {}
        paths = [("model", model_path), ("packed", packed_path)]
        paths += [("panels", panel_path)] if panels else []
        for name, run in paths:
            run()
            samples = []
            for _ in range(args.runs):
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
        results.append({"rows": rows, **{f"{name}_ms": round(t * 1e3, 1) for name, t in times.items()},
                        **{f"{name}_gb_per_s": round(total / t / 1e9, 2) for name, t in times.items()},
                        **{f"{name}_gflop_per_s": round(2 * rows * total / 4 / t / 1e9, 1)
                           for name, t in times.items()},
                        **{f"{name}_speedup": round(times["model"] / t, 2)
                           for name, t in times.items() if name != "model"}})
    print(json.dumps({"cpu": cpu_model(), "threads": 1, "weights_mb": round(total / 1e6, 1),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
