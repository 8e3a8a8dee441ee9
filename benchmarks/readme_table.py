"""The README's Performance tables, generated from committed benchmark records.

    python benchmarks/readme_table.py benchmarks/results/bench_ops-*.json benchmarks/results/bench_decode-*.json ...

Reads any mix of bench_ops / bench_decode / bench_verify / bench_spec / bench_sampled / bench_fp8 / step_blocks records (one JSON
line each) and prints markdown: one table per kind, each naming its file, device, date and git sha.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/readme_table.py`: `benchmarks` is at the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import placement  # noqa: E402


PROFILE_ROWS = 12  # kernel families listed per profile; the rest in one row
NAME_CHARS = 60    # cuBLAS kernel names run past 100 characters


def _head(path: str, r: dict) -> str:
    return f"`{Path(path).name}` ({r['device']}, {r['date']}, git {r['git_sha'][:7]}):"


def _preset(r: dict) -> str:
    """The preset, with the weights' dtype where the record names one and the pipeline split
    where it ran staged ("bench (fp8)", "bench-xl, stages 0-11,12-23 on GPUs 0,1")."""
    weights = r["config"].get("weights", "")
    where = placement(r["config"])
    return (r["config"]["preset"] + (f" ({weights.split(',')[0]})" if weights.startswith("fp8") else "")
            + ("," + where if where else ""))


def ops(path: str, r: dict) -> list[str]:
    rows = r["config"]["rows"]
    timed = "GPU time in a CUDA graph" if r["config"].get("graph_calls") else "time per call"
    out = [_head(path, r), "", f"| exact projection (in x out), {timed} / cuBLAS bf16 | "
           + " | ".join(f"t = {t}" for t in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, (d_in, d_out) in r["config"]["shapes"].items():
        cells = [f"{r['linear'][f'{name}_t{t}']['ratio']:.2f}x" for t in rows]
        out.append(f"| {d_in} x {d_out} | " + " | ".join(cells) + " |")
    entries = _op_entries(r)
    if entries:
        out += ["", "| op | peer | memra, graph | peer, graph | memra / peer, graph | memra / peer, per call | "
                "bytes | memra, of copy bw |", "|---" * 8 + "|"]
    for name, v in entries.items():
        p = v["peer"] or {}
        frac = v.get("memra_bandwidth_fraction") if v["memra_ms"] is not None else None
        out.append(f"| {name} | {p.get('name') or 'none: ' + str(v.get('peer_missing'))} | {_us(v['memra_ms'])} | "
                   f"{_us(p.get('ms')) if 'graph_refused' not in p else 'capture refused'} | {_x(v.get('ratio'))} | "
                   f"{_x(v.get('call_ratio'))} | {_mb(v.get('bytes'))} | "
                   + ("n/a" if frac is None else f"{100 * frac:.1f}%") + " |")
    return out


OLD_OPS = {"kda_recurrence_t1": "fla", "kda_recurrence_t8": "fla", "mla_attend_t1": "torch", "mla_attend_t8": "torch"}
OLD_PEERS = {"fla": "fla fused_recurrent_kda", "torch": "torch reference"}


def _op_entries(r: dict) -> dict:
    """A record's op entries (op_timing.op_entry). Records before graph timing on both sides held
    KDA and MLA at the top level, timed per host call: their one ratio is a per-call ratio and
    their graph cells stay empty (records before any peer, without memra_ms, are skipped)."""
    if "ops" in r:
        return r["ops"]
    out = {}
    for name, peer in OLD_OPS.items():
        v = r.get(name, {})
        if "memra_ms" not in v:
            continue
        p = v.get(peer)
        nbytes = v.get("bytes", v.get("latent_bytes_read"))
        out[name] = {"memra_ms": None, "memra_call_ms": v["memra_ms"], "bytes": nbytes,
                     "peer": p and {"name": OLD_PEERS[peer], "ms": None, "call_ms": p["ms"]},
                     "peer_missing": f"{OLD_PEERS[peer]} missing", "ratio": None, "call_ratio": v.get("ratio")}
    return out


def _us(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f} us" if ms < 0.01 else f"{ms * 1e3:.0f} us"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _mb(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:.2f} MB"


def decode(path: str, r: dict) -> list[str]:
    d = r["decode"]
    frac, eager = d["bandwidth_fraction"], d.get("eager") or d
    replay = d.get("replay_gpu_ms")  # absent from older records; None without captured graphs
    session = d.get("session")  # absent from older records
    out = [_head(path, r), "", f"| preset | context | decode ms/step ({d.get('mode', 'eager')}) | "
           + ("GPU ms/step (replay alone) | " if replay is not None else "") + "eager ms/step | tokens/s | "
           + ("session tokens/s | " if session else "") + "weights/step | of copy bw | host share | "
           + " | ".join(f"prefill {p['tokens']} tok/s" for p in r["prefill"].values()) + " |",
           "|---" * (8 + (replay is not None) + bool(session) + len(r["prefill"])) + "|"]
    out.append(f"| {_preset(r)} | {r['config']['context']} | {d['ms_per_step']:.2f} | " + (f"{replay:.3f} | " if replay is not None else "")
               + f"{eager['ms_per_step']:.2f} | {d['tokens_per_s']:.1f} | "
               + (f"{session['tokens_per_s']:.1f} | " if session else "")
               + f"{d['weight_bytes_per_step'] / 1e9:.2f} GB | {100 * frac:.0f}% | {100 * d['host_share']:.0f}% | "
               + " | ".join(f"{p['tokens_per_s']:.0f}" for p in r["prefill"].values()) + " |")
    out += _profile(d.get("kernel_profile"), "a replayed step")
    for name, p in r["prefill"].items():
        if "logits_vs_exact_class" in p:
            out += ["", f"The {p['tokens']}-token prime's last logits differ from the same prompt primed in "
                    f"exact-class walks by {p['logits_vs_exact_class']:.1e} of the largest logit."]
        out += _profile(p.get("kernel_profile"), f"the {p['tokens']}-token prime")
    return out


def _profile(prof: dict | None, what: str) -> list[str]:
    """A kernel profile's PROFILE_ROWS largest families and one row for the rest (records before
    the per-kernel profile have none); library kernels' long names are cut."""
    if not prof:
        return []
    out = ["", f"| kernel (GPU time of {what}: {prof['kernel_us_per_step'] / 1e3:.2f} ms; GPU idle "
           f"{100 * prof['idle_share']:.0f}% of the span) | us | calls | share |", "|---|---|---|---|"]
    families = list(prof["families"].items())
    for name, f in families[:PROFILE_ROWS]:
        name = name if len(name) <= NAME_CHARS else name[:NAME_CHARS] + "..."
        out.append(f"| {name} | {f['us_per_step']:.0f} | {f['calls_per_step']:.0f} | {100 * f['share']:.1f}% |")
    rest = families[PROFILE_ROWS:]
    if rest:
        out.append(f"| {len(rest)} others | {sum(f['us_per_step'] for _, f in rest):.0f} | "
                   f"{sum(f['calls_per_step'] for _, f in rest):.0f} | {100 * sum(f['share'] for _, f in rest):.1f}% |")
    return out


def verify(path: str, r: dict) -> list[str]:
    walks = list(r["verify"].values())
    where = f"{_preset(r)}, {r['config']['context']}-token context, decode step {r['decode_ms']:.2f} ms"
    out = [_head(path, r), "", f"| {where}: rows t | " + " | ".join(str(w["rows"]) for w in walks) + " |",
           "|---" * (len(walks) + 1) + "|",
           "| verify / decode step | " + " | ".join(f"{w['ratio_to_decode']:.2f}" for w in walks) + " |"]
    if all("verify_rows_ms" in w for w in walks):  # records before it timed the walk with the host copy only
        out.append("| with the [t, V] logits copied to the host / decode step | "
                   + " | ".join(f"{w['verify_rows_ms'] / r['decode_ms']:.2f}" for w in walks) + " |")
    if all("rollback_longest_ms" in w for w in walks):  # records before the state marks have no longest keep
        out.append("| rollback, ms: keep 1 / the longest replay / t - 1 | " + " | ".join(
            f"{w['rollback_keep1_ms']:.3f} / {w['rollback_longest_ms']:.3f} ({w['rollback_longest_keep']}) / "
            f"{w['rollback_keep_last_ms']:.3f}" for w in walks) + " |")
    widest = max(walks, key=lambda w: w["rows"])  # older records have no profile
    return out + _profile(widest.get("kernel_profile"), f"a {widest['rows']}-row walk with its rollback")


def spec(path: str, r: dict) -> list[str]:
    """Forced-acceptance points, and the same points with each real source's draft cost added.
    Records since the realised bound (tokens per round the timed rounds committed) say so."""
    plain = r["plain"]["tokens_per_s"]
    bound = "of its bound (realised)" if "realised_tokens_per_round" in r["spec"][0] else "of analytic bound"
    sources = list(r["spec"][0].get("with_draft_cost") or {})
    out = [_head(path, r), "", f"| alpha | K | tokens/s (plain {plain:.1f}) | x plain | {bound} |"
           + "".join(f" with {name} cost, x plain |" for name in sources),
           "|---|---|---|---|---|" + "---|" * len(sources)]
    for v in r["spec"]:
        costed = v.get("with_draft_cost") or {}
        out.append(f"| {v['alpha']} | {v['k']} | {v['tokens_per_s']:.1f} | {v['speedup_vs_plain']:.2f} | "
                   f"{100 * v['fraction_of_bound']:.0f}% |"
                   + "".join(f" {costed[n]['tokens_per_s'] / plain:.2f} |" if costed.get(n) else " n/a |"
                             for n in sources))
    return out


def sampled(path: str, r: dict) -> list[str]:
    """Plain greedy and sampled ms a token, and a sampled accept's ms, filter on the device vs the host."""
    p, a, c = r["plain_ms_per_token"], r["accept_ms"], r["config"]
    s = c["sampling"]
    knobs = ", ".join(f"{k} {v}" for k, v in s.items() if (k, v) not in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)))
    return [_head(path, r), "", f"| {_preset(r)} ({knobs}) | greedy | sampled | sampled, host filter | "
            f"accept of {c['rows']} rows | accept, host filter |", "|---|---|---|---|---|---|",
            f"| ms | {p['greedy']:.2f} | {p['sampled']:.2f} | {p['sampled_host_filter']:.2f} | {a['device']:.2f} | "
            f"{a['host']:.2f} |"]


def fp8(path: str, r: dict) -> list[str]:
    """Each op's FP8 time, against the copy roof's time for its bytes and against bf16."""
    out = [_head(path, r), "", "| op (GPU time in a CUDA graph, weights from HBM) | t | FP8 | of the copy time of "
           "its bytes | bf16 | FP8 / bf16 |", "|---|---|---|---|---|---|"]
    for name, v in r["ops"].items():
        if name.endswith("_fp8"):
            op, t = name[:-len("_fp8")].rsplit("_t", 1)
            bf16 = r["ops"][name[:-len("fp8")] + "bf16"]
            out.append(f"| {op} | {t} | {_us(v['ms'])} | {_x(v['of_roof'])} | {_us(bf16['ms'])} | "
                       f"{_x(v['fp8_over_bf16'])} |")
    return out


def blocks(path: str, r: dict) -> list[str]:
    """A replayed decode step by block kind, each against the copy time of its weights; or a
    prime's blocks (--prompt), each kind's wall and busy time and share of the span."""
    if r["blocks"] is None:
        return [_head(path, r), "", f"No blocks: {r['why']}."]
    if "prompt" in r:
        out = [_head(path, r), "", f"| block ({_preset(r)}, a {r['prompt']}-token prime: {r['prime_ms']:.1f} ms, "
               f"{r['profiled_span_us'] / 1e3:.1f} profiled, busy {r['busy_us'] / 1e3:.1f}) | blocks | ms each | "
               "busy ms each | of the span |", "|---|---|---|---|---|"]
        for kind, k in r["kinds"].items():
            out.append(f"| {kind} | {k['count']} | {k['us_each'] / 1e3:.2f} | {k['busy_us_each'] / 1e3:.2f} | "
                       f"{100 * k['share']:.1f}% |")
        return out
    out = [_head(path, r), "", f"| block ({_preset(r)}, {r['config']['context']}-token context; the step "
           f"{r['replay_ms']:.3f} ms, {r['profiled_step_us'] / 1e3:.3f} profiled, {100 * r['of_copy_bw']:.0f}% of "
           "copy bw) | blocks | us each | weights each | copy us each | of copy bw | us past copy, all |",
           "|---|---|---|---|---|---|---|"]
    for kind, k in r["kinds"].items():
        out.append(f"| {kind} | {k['count']} | {k['us_each']:.1f} | {_mb(k['bytes_each'])} | "
                   f"{k['copy_us_each']:.1f} | {100 * k['of_copy_bw']:.0f}% | {k['us_past_copy']:.0f} |")
    return out


TABLES = {"bench_ops": ops, "bench_decode": decode, "bench_verify": verify, "bench_spec": spec,
          "bench_sampled": sampled, "bench_fp8": fp8, "step_blocks": blocks}


def main(argv=None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        record = json.loads(Path(path).read_text())
        print("\n".join(TABLES[record["bench"]](path, record)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
