"""vLLM's CPU backend under its own torch profiler on a named workload, summarised per operator:
the peer's side of the per-op profile in docs/BENCHMARKS.md (ours: bench/step_profile.py).

    python bench/vllm_profile.py --workload W2 [--top 25]

The workload runs once untimed, then once profiled (bench/vllm_peer.py PROFILE_DIR); every
trace file vLLM writes is read and its operators' self times (each event's duration less its
children's, per thread) summed by name. Needs bench/setup_vllm_cpu.sh's venv and model.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_peers import BENCH, CACHE, vllm_env, workload_runs
from peer_common import peer_spec, write_json
from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS as WORKLOADS


def self_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter, float]:
    """Self microseconds and calls per operator name, and the traced span (us), from complete
    ("X") events of the CPU threads."""
    by_thread = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event and event.get("cat") in ("cpu_op",
                                                                             "user_annotation"):
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    totals, calls = collections.Counter(), collections.Counter()
    first, last = float("inf"), 0.0
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []          # [end, name, child time]
        for event in thread_events:
            start, dur = float(event["ts"]), float(event["dur"])
            first, last = min(first, start), max(last, start + dur)
            while stack and stack[-1][0] <= start:
                end, name, children, own = stack.pop()
                totals[name] += own - children
            if stack:
                stack[-1][2] += dur
            stack.append([start + dur, event["name"], 0.0, dur])
            calls[event["name"]] += 1
        while stack:
            end, name, children, own = stack.pop()
            totals[name] += own - children
    return totals, calls, last - first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W2", choices=["W1", "W2"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--venv", type=Path, default=CACHE / "vllm-venv")
    parser.add_argument("--model-dir", type=Path, default=CACHE / "smollm2-f32")
    args = parser.parse_args()
    runs = workload_runs(WORKLOADS[args.workload], 49152)
    spec = {**peer_spec(runs, WORKLOADS[args.workload].num_requests), "model": str(args.model_dir)}
    with tempfile.TemporaryDirectory(prefix="vllm-profile-") as tmp:
        tmp_path = Path(tmp)
        write_json(str(tmp_path / "spec.json"), spec)
        status = subprocess.run(
            [str(args.venv / "bin" / "python"), str(BENCH / "vllm_peer.py"),
             str(tmp_path / "spec.json"), str(tmp_path / "result.json"), str(tmp_path / "traces")],
            env=vllm_env(args.venv), check=False).returncode
        if status != 0:
            sys.exit(f"bench/vllm_peer.py failed with status {status}")
        events = []
        for trace in sorted((tmp_path / "traces").rglob("*.json")):
            events += json.loads(trace.read_text()).get("traceEvents", [])
            print(f"trace {trace.name}: {trace.stat().st_size / 1e6:.1f} MB")
    totals, calls, span = self_times(events)
    print(f"{args.workload}: traced span {span / 1e6:.2f} s; self time by operator (all threads):")
    print(f"{'operator':<60} {'self ms':>10} {'calls':>8} {'% of span':>9}")
    for name, micros in totals.most_common(args.top):
        print(f"{name[:60]:<60} {micros / 1e3:>10.1f} {calls[name]:>8} {100 * micros / span:>8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
