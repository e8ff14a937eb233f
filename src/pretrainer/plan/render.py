"""A plan as text (the table `pretrainer plan` prints) and as JSON (`--json`)."""

from __future__ import annotations

import shlex

from .device_spec import CPU_MFU, GIB, size
from .estimate import Estimate
from .planner import Plan

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "logits", "communication", "runtime")
DEFAULT_NOTES = {"gradients": "fp32", "optimizer": "AdamW moments (fp32)",
                 "logits": "fp32 logits or log-softmax and two gradients of that size (one chunk when chunked)",
                 "communication": "-"}


def listed(plan: Plan, count: int) -> list[Estimate]:
    """The alternatives worth showing: those that fit, best first (search.ranked); if none fit, the smallest."""
    fitting = plan.fitting(count)
    return fitting or sorted(plan.alternatives, key=lambda e: e.peak)[:count]


def assumptions(estimate: Estimate) -> str:
    device = estimate.device
    if device.kind == "cpu":
        return (f"an assumed {CPU_MFU:.0%} MFU of {device.peak_tflops:,.3g} TFLOP/s per process; communication at "
                f"{device.intra_node_bandwidth / 1e9:g} GB/s between processes, not overlapped with compute")
    traffic = f" ({estimate.notes['elementwise']})" if "elementwise" in estimate.notes else ""
    return (f"kernels at the rates of {device.peak_tflops:,.3g} TFLOP/s and {device.memory_bandwidth / 1e12:.3g} TB/s "
            f"per device{traffic}; links {device.intra_node_bandwidth / 1e9:g} GB/s within a node and "
            f"{device.inter_node_bandwidth / 1e9:g} GB/s between nodes ({device.link_source}); "
            f"{estimate.hidden_seconds:,.3g} s more of collectives overlapped with compute")


def text(plan: Plan, count: int = 8) -> str:
    own = plan.estimate
    lines = [f"model: {plan.shape.describe()}", f"layout: {own.layout.describe()}",
             f"device: {own.device.describe()}", "", f"{'per rank':<16}{'GiB':>9}  what"]
    sizes = own.per_rank_bytes()
    default_notes = {**DEFAULT_NOTES, "runtime": own.device.runtime_source}
    rows = [(name, sizes[name], own.notes.get(name) or default_notes.get(name, "")) for name in COMPONENTS]
    rows += [row for row in (("loading", own.loading, own.notes.get("loading")),
                             ("heap retained", own.retained, own.notes.get("heap_retained")),
                             ("host offload", own.host_offload, "in host memory, not the device's"),
                             ("host peak", own.host_peak, f"of {size(own.device.host_memory_bytes)} host memory per "
                                                          f"rank ({own.device.host_memory_source})"))
             if row[1]]  # shown where they hold anything
    lines += [f"  {name:<14}{value / GIB:>9.2f}  {note}" for name, value, note in rows]
    verdict = "fits" if own.fits else "does NOT fit"
    heap = f", tensors x {own.heap_overhead:g} for the CPU heap" if own.device.kind == "cpu" else ""
    lines.append(f"  {'peak':<14}{own.peak / GIB:>9.2f}  {verdict} in {own.device.memory_bytes / GIB:,.1f} GiB "
                 f"(runtime + the larger of backward's start and the optimizer step{heap})")
    lines += ["", f"step: ~{own.step_seconds:,.3g} s (compute {own.compute_seconds:,.3g} s, communication "
              f"{own.communication_seconds:,.3g} s), from {assumptions(own)}", ""]
    if plan.ramp_stages:
        lines.append("batch ramp (batch_size_schedule), each stage by its micro-batches per replica:")
        lines += [f"  from token {start:>14,}: {seqs:>6} sequences, {e.layout.accumulation:>4} micro-batches: "
                  f"~{e.step_seconds:,.3g} s a step, peak {e.peak / GIB:.2f} GiB"
                  for start, seqs, e in plan.ramp_stages]
        lines.append("")
    if plan.length_stages:
        lines.append("sequence-length stages (seq_length_schedule), the same tokens per micro-batch in each:")
        lines += [f"  {s.describe()}: {s.estimate.layout.micro_batch} windows a micro-batch, "
                  f"~{s.estimate.step_seconds:,.3g} s a step, peak {s.estimate.peak / GIB:.2f} GiB"
                  + ("" if s.estimate.fits else " -- does NOT fit") for s in plan.length_stages]
        lines.append("")
    if plan.data_plan:
        lines += ["data mixture, the plan of draws (train_data):", *plan.data_plan.splitlines(), ""]
    if plan.fitting(1):
        lines.append("layouts that fit, best first: within 5% of the fastest the simplest, then the smallest; then "
                     "the rest, fastest first (add the overrides to the command line):")
    else:
        lines.append("no layout of this world fits; the smallest (more processes, a larger device or a smaller "
                     "micro-batch/sequence are needed):")
    lines += [f"  {e.step_seconds:>8,.3g} s {e.peak / GIB:>8.2f} GiB  {shlex.join(e.layout.overrides())}"
              for e in listed(plan, count)]
    return "\n".join(lines)


def as_json(plan: Plan, count: int = 50) -> dict:
    own = plan.estimate
    return {
        "model": plan.shape.describe(),
        "vocab_size": plan.shape.vocab,  # the rows the run trains (a grown vocabulary padded for tp)
        "loss_chunk_size": own.layout.loss_chunk,  # 0: the plain loss
        "layout": own.layout.overrides(),
        "per_rank_bytes": own.per_rank_bytes(),
        "pipeline_stage": own.stage or None,  # the stage whose rank peaks highest (first/last), None without pp
        "device": own.device.name,
        "device_memory_bytes": own.device.memory_bytes,
        "host_memory_bytes": own.device.host_memory_bytes,
        "fits": own.fits,
        "step_seconds": own.step_seconds,
        "ramp_stages": [{"from_tokens": start, "sequences": seqs, "accumulation": e.layout.accumulation,
                         "step_seconds": e.step_seconds, "peak_bytes": e.peak} for start, seqs, e in plan.ramp_stages],
        "length_stages": [{"stage": s.number, "seq_length": s.seq_length, "from_tokens": s.from_tokens,
                           "until_tokens": s.until_tokens, "micro_batch": s.estimate.layout.micro_batch,
                           "step_seconds": s.estimate.step_seconds, "peak_bytes": s.estimate.peak,
                           "fits": s.estimate.fits} for s in plan.length_stages],
        "assumptions": assumptions(own),
        "data_plan": plan.data_plan,
        "layouts": [{"overrides": e.layout.overrides(), "peak_bytes": e.peak, "fits": e.fits,
                     "step_seconds": e.step_seconds} for e in listed(plan, count)],
    }
