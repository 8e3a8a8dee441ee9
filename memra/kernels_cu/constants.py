"""The constants the .cu kernels and their Python wrappers share: one home each.

    from memra.kernels_cu.constants import BF16_OUTS, FLAGS, DEFINES

Every kernel family is built with each entry of KERNEL_CONSTANTS as a `-DNAME=value` define
(backend/cuda/runtime.py for NVRTC, tests/backend/test_kernels_compile.py for nvcc), and the
wrappers size their grids and check their bounds with the same names. No hand-written `.cu`/`.cuh`
file defines them (tests/backend/test_kernel_constants.py). `constants.cuh` is generated from this
table (`header_text()`, checked by a test) so a plain `nvcc file.cu` builds the same sizes; its
`#ifndef` entries give way to the build's defines. Constants only one side needs stay there (a kernel's inner tile shapes, a
wrapper's dispatch thresholds). This module imports no cupy, so CPU-only tests can read it.
"""

from __future__ import annotations

from memra.limits import VERIFY_CAP

# Exact-class build flags (DESIGN.md section 2): C++17, no FMA contraction, never fast-math.
FLAGS = ("--std=c++17", "--fmad=false")

# every family (common.cuh): threads per block of the row reductions, a fixed split size
MEMRA_BLOCK = 256
WARPS_PER_BLOCK = MEMRA_BLOCK // 32

# dense.cu: float32 projections, row template T -> outputs per warp (the kernels t1 .. t16)
OUTS_PER_WARP = {1: 1, 2: 2, 4: 4, 8: 4, 16: 2}
BF16_OUTS = 32    # outputs per block of a bf16 (tensor-core) projection or MoE down tile
SPLIT_KC = 2048   # in-features per split-K slice of a bf16 projection (a size, never a count)
FP8_BLOCK = 128   # FP8 weights: one scale per FP8_BLOCK x FP8_BLOCK block (the release's weight_block_size)

# norm.cu: the sum-of-squares norms give rows of at most this many elements a warp each
NORM_WARP_ROW = 4 * MEMRA_BLOCK

# hyper.cu
HC_MAX_N = 8                  # streams: hc_weights holds the n x n mix in a warp, n^2 / 32 a lane
HC_CHUNK = MEMRA_BLOCK * 8    # flattened stream elements per hc_partials block
HC_SLOTS = 4                  # fn dots (or the sum of squares) per hc_partials block
HC_ROWS = 4                   # rows per hc_partials block: each fn value loaded serves them all
HC_VECTOR = 4                 # channels a thread of a prompt's hc_collapse_site / hc_combine (a float4)

# kda.cu
KDA_MAX_CONV = 16   # conv taps held in registers
KDA_MAX_DK = 256    # key dim: kda_recurrence_k32's threads hold 32 keys of a state column
KDA_COLS = 32       # state columns per kda_recurrence block: a lane each in 8 warps (MEMRA_BLOCK / 32)
KDA_MARK_ROWS = 4   # a verify walk keeps its state every this many rows: a rollback replays < 4 rows
KDA_GATE_VECTOR = 4  # channels a thread of a prompt's kda_gate (a float4)
KDA_CONV_SPAN = 64  # a prompt's short_conv rows per thread (short_conv_spans)
KDA_CONV_LANES = 32  # short_conv: channels a block, a lane each, the walk's rows over its warps

# kda_chunks.cu: a prompt's chunked delta-rule scan (prime class)
KDA_CHUNK = 16          # rows per chunk: the in-chunk solve is KDA_CHUNK x KDA_CHUNK
KDA_CHUNK_MAX_DK = 128  # key dim of the chunked scan
KDA_SCAN_KEYS = 16      # keys of a value column a scan thread holds: MAX_DK / 16 = 8 warps a block

# kpool.cu
KPOOL_POOLS = 8     # pools per kpool_scores block: a thread a (pool, head) dot, 32 heads x 8 = 256

# mla.cu
MIX_CHANNELS = 128  # latent channels per mla_mix block (four per lane)
MIX_SPLIT = 64      # list entries per mla_mix partial: a split size, never a count
MIX_STEP = 16       # list entries per mla_mix shared-memory step; a split is a multiple

# moe.cu
MOE_MAX_EXPERTS = 3072   # moe_expert_list marks experts in shared memory (route_select: 12 KB of scores)
MAX_TOPK = 32            # moe_route_select places the chosen experts in shared memory
MAX_GROUPS = 64          # ... and the kept groups in a 64-bit mask
GATE_UP_UNITS = 16       # intermediate units per bf16 gate|up tile (16 gate rows, 16 up rows)

# prime.cu: values a thread of the elementwise kernels where a row's length allows (16-byte loads)
PIECES_VECTOR = 4     # bf16_pieces, swiglu_pieces: float32 values
FP8_PIECES_WIDTH = 8  # fp8_pieces: e4m3 bytes

# draft.cu
DRAFT_MAX_HD = 256  # a block attention head: each lane holds DRAFT_MAX_HD / 32 of its query and output

KERNEL_CONSTANTS: dict[str, int] = {
    "MEMRA_BLOCK": MEMRA_BLOCK,
    "WARPS_PER_BLOCK": WARPS_PER_BLOCK,
    **{f"OUTS_PER_WARP_T{t}": o for t, o in OUTS_PER_WARP.items()},
    "BF16_OUTS": BF16_OUTS,
    "SPLIT_KC": SPLIT_KC,
    "FP8_BLOCK": FP8_BLOCK,
    "VERIFY_CAP": VERIFY_CAP,
    "NORM_WARP_ROW": NORM_WARP_ROW,
    "HC_MAX_N": HC_MAX_N,
    "HC_CHUNK": HC_CHUNK,
    "HC_SLOTS": HC_SLOTS,
    "HC_ROWS": HC_ROWS,
    "HC_VECTOR": HC_VECTOR,
    "KDA_MAX_CONV": KDA_MAX_CONV,
    "KDA_MAX_DK": KDA_MAX_DK,
    "KDA_COLS": KDA_COLS,
    "KDA_MARK_ROWS": KDA_MARK_ROWS,
    "KDA_GATE_VECTOR": KDA_GATE_VECTOR,
    "KDA_CONV_SPAN": KDA_CONV_SPAN,
    "KDA_CONV_LANES": KDA_CONV_LANES,
    "KDA_CHUNK": KDA_CHUNK,
    "KDA_CHUNK_MAX_DK": KDA_CHUNK_MAX_DK,
    "KDA_SCAN_KEYS": KDA_SCAN_KEYS,
    "KPOOL_POOLS": KPOOL_POOLS,
    "MIX_CHANNELS": MIX_CHANNELS,
    "MIX_SPLIT": MIX_SPLIT,
    "MIX_STEP": MIX_STEP,
    "MOE_MAX_EXPERTS": MOE_MAX_EXPERTS,
    "MAX_TOPK": MAX_TOPK,
    "MAX_GROUPS": MAX_GROUPS,
    "GATE_UP_UNITS": GATE_UP_UNITS,
    "PIECES_VECTOR": PIECES_VECTOR,
    "FP8_PIECES_WIDTH": FP8_PIECES_WIDTH,
    "DRAFT_MAX_HD": DRAFT_MAX_HD,
}

DEFINES = tuple(f"-D{name}={value}" for name, value in KERNEL_CONSTANTS.items())


HEADER = "constants.cuh"


def header_text() -> str:
    """constants.cuh, generated: `python -m memra.kernels_cu.constants > memra/kernels_cu/constants.cuh`."""
    lines = ["// Generated from memra/kernels_cu/constants.py (header_text); edit the table there, not here.",
             "// The build passes the same values as -D defines; these let a plain `nvcc file.cu` build.",
             "#pragma once"]
    for name, value in KERNEL_CONSTANTS.items():
        lines += [f"#ifndef {name}", f"#define {name} {value}", "#endif"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(header_text(), end="")
