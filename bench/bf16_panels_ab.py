"""bf16 projections on the library's panels (runtime/layers/bf16_panels.py) against oneDNN's
prepacked weights, alternating in one process on the same weights.

    python bench/bf16_panels_ab.py products [--shapes 960x576,576x1536] [--rows 1,16,64,512]
    python bench/bf16_panels_ab.py engine [--model smollm2] [--batch 1] [--prompt 512]

products: each shape's product at each row count over --layers distinct weights in turn (so
that they come from memory, as in a step), the two forms alternating --rounds times; prints
the median times and their ratio. engine: a --quantization none bfloat16 worker in this
process, its projections swapped between the two forms between steps (the panels kept by the
loader, oneDNN's packed from the same bf16 weights): decode steps of --batch requests and
--prompt-token prefill steps, alternating. Ratios < 1: the panels are faster."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from spmd_runtime.runtime.layers import bf16_panels, cpu_ops
from spmd_runtime.runtime.layers.linear import PackedWeight, linear
from spmd_runtime.runtime.layers.quantization import swap_weight


def alternate(runs: dict, rounds: int) -> dict[str, float]:
    """Each callable run once to warm, then `rounds` times alternating: the median seconds."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def products(args: argparse.Namespace) -> None:
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    for out_features, in_features in shapes:
        weights = [(torch.randn(out_features, in_features) * 0.02).bfloat16()
                   for _ in range(args.layers)]
        forms = {"onednn": [PackedWeight.pack(w) for w in weights],
                 "panels": [bf16_panels.PanelWeight.pack(w) for w in weights]}
        del weights
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features).bfloat16()
            medians = alternate({name: (lambda held=held, x=x: [linear(x, w) for w in held])
                                 for name, held in forms.items()}, args.rounds)
            print(f"{out_features}x{in_features} rows {rows:>5}: oneDNN "
                  f"{medians['onednn'] * 1e3:8.2f} ms, panels {medians['panels'] * 1e3:8.2f} ms, "
                  f"ratio {medians['panels'] / medians['onednn']:.2f}")


def engine(args: argparse.Namespace) -> None:
    from spmd_runtime.protocol.config import EngineConfig
    from spmd_runtime.protocol.messages import NewRequestData, StepPlan
    from spmd_runtime.protocol.sampling import SamplingParams
    from spmd_runtime.worker_proc.distributed import DistributedContext
    from spmd_runtime.worker_proc.worker import build_runner

    plains: dict[int, torch.Tensor] = {}
    pack = bf16_panels.PanelWeight.pack.__func__

    def keeping(cls, weight):
        packed = pack(cls, weight)
        plains[id(packed)] = weight.detach().clone()
        return packed

    bf16_panels.PanelWeight.pack = classmethod(keeping)
    config = EngineConfig(model=args.model, dtype="bfloat16", device="cpu", quantization="none",
                          num_kv_blocks=args.kv_blocks)
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                             backend="gloo")
    runner, _ = build_runner(config, ctx)
    bf16_panels.PanelWeight.pack = classmethod(pack)
    model = runner.model
    slots = [*model.projection_slots(), (model, "lm_head")]
    panels = {i: getattr(m, n) for i, (m, n) in enumerate(slots) if id(getattr(m, n)) in plains}
    if not panels:
        raise SystemExit("no projection was held as panels on this CPU (AMX, no AVX512-BF16, "
                         "or shapes they do not take): nothing to compare")
    forms = {"onednn": {i: PackedWeight.pack(plains[id(w)]) for i, w in panels.items()},
             "panels": panels}
    plains.clear()
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    state = {"block": 1, "step": 0, "request": 0}

    def request(length: int) -> NewRequestData:
        count = -(-(length + 2 * (args.rounds + 1) * args.decode_steps + 16) // config.block_size)
        if state["block"] + count >= args.kv_blocks:
            state["block"] = 1          # reuse the cache's blocks: their contents do not matter
        blocks = list(range(state["block"], state["block"] + count))
        state["block"] += count
        state["request"] += 1
        return NewRequestData(state["request"], torch.randint(
            0, model.config.vocab_size, (length,), generator=generator).tolist(), blocks, 0,
            length, params)

    def execute(plan_args) -> None:
        state["step"] += 1
        runner.execute(StepPlan(state["step"], *plan_args))

    batch = [request(args.context) for _ in range(args.batch)]
    for first in range(0, len(batch), 8):
        execute((batch[first:first + 8], [], [], [], []))
    ids = [r.request_id for r in batch]

    def with_form(name: str, body):
        def run() -> None:
            for i, weight in forms[name].items():
                swap_weight(*slots[i], weight)
            body()
        return run

    def decode() -> None:
        for _ in range(args.decode_steps):
            execute(([], ids, [1] * len(ids), [[] for _ in ids], []))

    def prefill() -> None:
        execute(([request(args.prompt)], [], [], [], []))

    for what, body, count in (("decode step", decode, args.decode_steps), ("prefill step", prefill, 1)):
        medians = alternate({name: with_form(name, body) for name in forms}, args.rounds)
        print(f"{what} ({args.batch if body is decode else args.prompt} "
              f"{'requests' if body is decode else 'tokens'}): oneDNN "
              f"{medians['onednn'] / count * 1e3:.1f} ms, panels "
              f"{medians['panels'] / count * 1e3:.1f} ms, ratio "
              f"{medians['panels'] / medians['onednn']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("products")
    p.add_argument("--shapes", default="960x576,576x576,3072x576,576x1536")
    p.add_argument("--rows", default="1,8,16,32,64,512")
    p.add_argument("--layers", type=int, default=24, help="distinct weights a shape, in turn")
    p.add_argument("--rounds", type=int, default=7)
    e = sub.add_parser("engine")
    e.add_argument("--model", default="smollm2")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--context", type=int, default=176)
    e.add_argument("--prompt", type=int, default=512)
    e.add_argument("--decode-steps", type=int, default=5)
    e.add_argument("--rounds", type=int, default=5)
    e.add_argument("--kv-blocks", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    if not cpu_ops.load():
        raise SystemExit("the C++ library is not built for this CPU: make env")
    (products if args.mode == "products" else engine)(args)


if __name__ == "__main__":
    main()
