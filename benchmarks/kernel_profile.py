"""Per-kernel GPU time of a run of decode steps, read from CUPTI through torch.profiler.

CUPTI records every kernel the process launches, cupy's RawModule kernels and the nodes of a
replayed CUDA graph included, with its device start and end; so the shares below are GPU time,
not host-call time. torch serves here only as the profiler front end (a benchmark tool, like
the peers in peers.py); without torch, or without kernels recorded, the profile is None.

    prof = kernel_profile(lambda: greedy_steps(model, cache, token, 16), 16, list(launches))
    prof["families"]["dense.linear_bf16_split_n1"]["share"]   # of the summed kernel time

A kernel's time is its own: the part of its span past the kernels that started before it (a
dependent launch's wait for its predecessor is not its work; _own_us).
"""

from __future__ import annotations

PROFILE_LINES = 16  # kernel families on a benchmark's card (the JSON has them all)


def _family(name: str, owner: dict[str, str]) -> str:
    """'dense.linear_bf16_n1' for a memra kernel (owner: kernel name -> its kernels_cu module),
    the bare name for anything else (a copy, a memset)."""
    base = name.split("(")[0].strip()
    return f"{owner[base]}.{base}" if base in owner else name


def _own_us(spans: list[tuple[float, float]]) -> list[float]:
    """Each (start, end) span's own microseconds: the part past every span that started before
    it. A kernel of a captured walk starts early (programmatic dependent launch) and waits at its
    entry until its predecessor ends, so only the time after that end is its work. Spans that do
    not overlap keep end - start; the own times add up to the busy time."""
    own, reach = [0.0] * len(spans), float("-inf")
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, end = spans[i]
        own[i] = max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return own


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) spans."""
    return sum(_own_us(spans))


def kernel_spans(run) -> list[tuple[str, float, float]] | None:
    """(kernel name, start us, end us) of every kernel run() puts on the GPU, by start; None
    without torch's profiler, without CUDA (run() is not called then) or without kernels recorded."""
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():  # CUPTI records nothing, and torch refuses a profile of no activity
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sorted(kernels, key=lambda k: k[1]) or None


def kernel_profile(run, steps: int, launched: list[str]) -> dict | None:
    """Profile run() (steps decode steps): kernel GPU time per family and per step, its share
    of the summed kernel time, and the GPU's idle share of the span (launch gaps, host waits).
    launched: the 'module.kernel' names counted_launches saw, to name each kernel's module."""
    kernels = kernel_spans(run)
    if not kernels:
        return None
    owner = dict(reversed(k.split(".", 1)) for k in launched)
    spans = [(start, end) for _, start, end in kernels]
    per = {}
    for (name, _, _), us in zip(kernels, _own_us(spans)):
        fam = per.setdefault(_family(name, owner), {"us": 0.0, "calls": 0})
        fam["us"] += us
        fam["calls"] += 1
    total = sum(f["us"] for f in per.values())
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    families = {name: {"us_per_step": f["us"] / steps, "calls_per_step": f["calls"] / steps,
                       "share": f["us"] / total}
                for name, f in sorted(per.items(), key=lambda kv: -kv[1]["us"])}
    return {"steps": steps, "kernel_us_per_step": total / steps, "span_us_per_step": span / steps,
            "busy_us_per_step": busy_us(spans) / steps, "idle_share": 1 - busy_us(spans) / span,
            "families": families}


def profile_lines(prof: dict | None, what: str) -> list[str]:
    """A card's lines for a kernel profile: the total, then the PROFILE_LINES largest families."""
    if not prof:
        return []
    lines = [f"  kernels of {what}: {prof['kernel_us_per_step'] / 1e3:.3f} ms of GPU time, "
             f"GPU idle {100 * prof['idle_share']:.1f}% of the span"]
    for name, f in list(prof["families"].items())[:PROFILE_LINES]:
        lines.append(f"    {100 * f['share']:5.1f}%  {f['us_per_step']:10.1f} us  {f['calls_per_step']:7.1f} calls  {name}")
    return lines
