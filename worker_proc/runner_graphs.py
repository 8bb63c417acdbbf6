"""The ModelRunner's graph runner: compilation of the layer pieces, warmup of every bucket, and
CUDA graphs of the buckets with their lookup. A component the ModelRunner owns; it builds its
inputs with the StepInputs it shares with its owner."""
from __future__ import annotations

import logging

import torch
from spmd_runtime.protocol.buckets import (
    PHASES,
    Bucket,
    GraphPhaseReport,
    PhaseBuckets,
    plan_graph_captures,
)
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.runtime.models.layer_pieces import LayerPieces
from spmd_runtime.runtime.models.llama import LlamaForCausalLM
from spmd_runtime.worker_proc.graphs import BucketGraph, GraphCapturer, StaticInputs
from spmd_runtime.worker_proc.step_inputs import StepInputs

log = logging.getLogger("spmd.worker")


class GraphRunner:
    """Compiled pieces per token count, warmup of every bucket, and graph capture and lookup."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 inputs: StepInputs) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        # Compiled layer pieces (--execution-mode compiled), and the token counts they have been run at.
        self.compiled: LayerPieces | None = None
        self.compiled_shapes: set[int] = set()
        # Captured graphs by their bucket; a bucket without one runs eagerly.
        self.graphs: dict[StepShape, BucketGraph] = {}
        self.warmed_up = False

    def compile_pieces(self, num_shapes: int) -> None:
        """Compile the layers' dense pieces, one graph per token count (dynamic=False)."""
        import torch._dynamo
        # Every layer shares the pieces' code, so the limit is per shape, not per layer.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   num_shapes + 8)
        eager = self.model.pieces
        self.compiled = LayerPieces(torch.compile(eager.attention_inputs, dynamic=False),
                                    torch.compile(eager.mlp_inputs, dynamic=False))

    def eager_pieces(self) -> LayerPieces:
        """The layers' eager dense parts: the C++ fused passes where the worker's attention
        backend has them (and the model's family runs them)."""
        return self.model.layer_pieces(self.inputs.attention)

    def pieces_for(self, bucket: StepShape | None, num_tokens: int) -> tuple[LayerPieces, int]:
        """Compiled pieces for a bucketed batch, eager ones otherwise (a batch outside every
        bucket is not worth a compilation). Also: 1 if this shape compiles after warmup."""
        if self.compiled is None or bucket is None:
            return self.eager_pieces(), 0
        new_shape = num_tokens not in self.compiled_shapes
        self.compiled_shapes.add(num_tokens)
        return self.compiled, int(new_shape and self.warmed_up)

    @torch.inference_mode()
    def warmup(self, buckets: dict[Phase, PhaseBuckets], free_memory, packed_tokens: int = 0) -> None:
        """Run each bucket shape once with padding only, largest first, before serving; a
        packed phase once at `packed_tokens` (the token budget), its largest step.

        The dense pieces (what compiles) depend on the token count alone and attention runs
        eagerly, so buckets with the same token count share one run: for decode, the one with
        the shortest context."""
        for phase in PHASES:
            order = warmup_shapes(buckets[phase], packed_tokens)
            for index, (bs, length) in enumerate(order, 1):
                log.info("[Warmup][%s][%d/%d] batch_size:%d seq_len:%d free_mem:%.2f GiB",
                         phase.capitalize(), index, len(order), bs, length,
                         free_memory() / 2**30)
                shape = StepShape(phase, bs, length)
                input_ids, positions, batch, _, _ = self.inputs.build([], shape)
                pieces, _ = self.pieces_for(shape, len(input_ids))
                self.model(input_ids, positions, self.kv_caches, batch, pieces)
        self.warmed_up = True

    # ------------------------------------------------------------------ graphs

    def graph_for(self, bucket: StepShape | None,
                   scheduled: list[tuple[int, int]]) -> BucketGraph | None:
        """The bucket's graph, if it has one and the batch has its layout: every decode
        bucket does; a prompt graph takes fresh prompts only (no cached context to attend)."""
        graph = self.graphs.get(bucket) if bucket is not None else None
        if graph is None or bucket.phase is Phase.DECODE:
            return graph
        fits = len(scheduled) <= bucket.batch_size and all(n <= bucket.length
                                                          for _, n in scheduled)
        fresh = all(self.inputs.requests[r].num_computed_tokens == 0 for r, _ in scheduled)
        return graph if fits and fresh else None

    def prepare_for_graph(self, scheduled: list[tuple[int, int]], bucket: StepShape
                           ) -> tuple[StaticInputs, list[int], list[int]]:
        """Host tensors of the bucket's shape (copied into the graph's own by BucketGraph)."""
        host = torch.device("cpu")
        if bucket.phase is Phase.PROMPT:
            return self.inputs.prompt_rows(scheduled, bucket.batch_size, bucket.length, host)
        input_ids, positions, batch, sample_rows, sample_ids = self.inputs.build(scheduled, bucket,
                                                                                 host)
        return StaticInputs(input_ids, positions, batch), sample_rows, sample_ids

    def _static_inputs(self, shape: StepShape) -> StaticInputs:
        """Padding-only inputs of a bucket's shape, on the device: what its graph reads."""
        if shape.phase is Phase.PROMPT:
            return self.inputs.prompt_rows([], shape.batch_size, shape.length,
                                           self.inputs.device)[0]
        input_ids, positions, batch, _, _ = self.inputs.build([], shape)
        # The decode group covers every row, padding included: nothing to zero.
        batch.pad_start = None
        return StaticInputs(input_ids, positions, batch)

    @torch.inference_mode()
    def capture_graphs(self, buckets: dict[Phase, PhaseBuckets], budget_bytes: int,
                       prompt_ratio: float, strategies: dict[Phase, str], free_memory,
                       capturer: GraphCapturer) -> dict[Phase, GraphPhaseReport]:
        """Capture bucket graphs within `budget_bytes`, split between the phases and ordered
        by their strategies (protocol.buckets.plan_graph_captures); logs each capture."""
        counters = dict.fromkeys(buckets, 0)

        def capture(phase: Phase, bucket: Bucket) -> int:
            counters[phase] += 1
            before = free_memory()
            log.info("[Warmup][Graph/%s][%d/%d] batch_size:%d seq_len:%d free_mem:%.2f GiB",
                     phase.capitalize(), counters[phase], len(buckets[phase].buckets), *bucket,
                     before / 2**30)
            shape = StepShape(phase, *bucket)
            inputs = self._static_inputs(shape)
            replay = capturer.capture(lambda: self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.batch))
            self.graphs[shape] = BucketGraph(inputs, replay)
            return before - free_memory()

        reports = plan_graph_captures({p: b.buckets for p, b in buckets.items()}, budget_bytes,
                                      prompt_ratio, strategies, capture)
        for report in reports.values():
            log.info("%s", report.line())
        return reports


def warmup_shapes(phase_buckets: PhaseBuckets, packed_tokens: int) -> list[Bucket]:
    """The (batch size, length) shapes warmup runs for a phase, largest token count first: one
    per token count (for decode, the shortest context), or for a packed phase one step of
    `packed_tokens` tokens."""
    if phase_buckets.packed:
        return [(1, packed_tokens)] if packed_tokens else []
    phase, shapes = phase_buckets.phase, {}
    for bs, length in phase_buckets.buckets:
        tokens = phase.tokens(bs, length)
        if tokens not in shapes or (phase is Phase.DECODE and length < shapes[tokens][1]):
            shapes[tokens] = (bs, length)
    return [shape for _, shape in sorted(shapes.items(), reverse=True)]
