// Generated from memra/kernels_cu/constants.py (header_text); edit the table there, not here.
// The build passes the same values as -D defines; these let a plain `nvcc file.cu` build.
#pragma once
#ifndef MEMRA_BLOCK
#define MEMRA_BLOCK 256
#endif
#ifndef WARPS_PER_BLOCK
#define WARPS_PER_BLOCK 8
#endif
#ifndef OUTS_PER_WARP_T1
#define OUTS_PER_WARP_T1 1
#endif
#ifndef OUTS_PER_WARP_T2
#define OUTS_PER_WARP_T2 2
#endif
#ifndef OUTS_PER_WARP_T4
#define OUTS_PER_WARP_T4 4
#endif
#ifndef OUTS_PER_WARP_T8
#define OUTS_PER_WARP_T8 4
#endif
#ifndef OUTS_PER_WARP_T16
#define OUTS_PER_WARP_T16 2
#endif
#ifndef BF16_OUTS
#define BF16_OUTS 32
#endif
#ifndef SPLIT_KC
#define SPLIT_KC 2048
#endif
#ifndef FP8_BLOCK
#define FP8_BLOCK 128
#endif
#ifndef VERIFY_CAP
#define VERIFY_CAP 15
#endif
#ifndef NORM_WARP_ROW
#define NORM_WARP_ROW 1024
#endif
#ifndef HC_MAX_N
#define HC_MAX_N 8
#endif
#ifndef HC_CHUNK
#define HC_CHUNK 2048
#endif
#ifndef HC_SLOTS
#define HC_SLOTS 4
#endif
#ifndef HC_ROWS
#define HC_ROWS 4
#endif
#ifndef HC_VECTOR
#define HC_VECTOR 4
#endif
#ifndef KDA_MAX_CONV
#define KDA_MAX_CONV 16
#endif
#ifndef KDA_MAX_DK
#define KDA_MAX_DK 256
#endif
#ifndef KDA_COLS
#define KDA_COLS 32
#endif
#ifndef KDA_MARK_ROWS
#define KDA_MARK_ROWS 4
#endif
#ifndef KDA_GATE_VECTOR
#define KDA_GATE_VECTOR 4
#endif
#ifndef KDA_CONV_SPAN
#define KDA_CONV_SPAN 64
#endif
#ifndef KDA_CONV_LANES
#define KDA_CONV_LANES 32
#endif
#ifndef KDA_CHUNK
#define KDA_CHUNK 16
#endif
#ifndef KDA_CHUNK_MAX_DK
#define KDA_CHUNK_MAX_DK 128
#endif
#ifndef KDA_SCAN_KEYS
#define KDA_SCAN_KEYS 16
#endif
#ifndef KPOOL_POOLS
#define KPOOL_POOLS 8
#endif
#ifndef MIX_CHANNELS
#define MIX_CHANNELS 128
#endif
#ifndef MIX_SPLIT
#define MIX_SPLIT 64
#endif
#ifndef MIX_STEP
#define MIX_STEP 16
#endif
#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 3072
#endif
#ifndef MAX_TOPK
#define MAX_TOPK 32
#endif
#ifndef MAX_GROUPS
#define MAX_GROUPS 64
#endif
#ifndef GATE_UP_UNITS
#define GATE_UP_UNITS 16
#endif
#ifndef PIECES_VECTOR
#define PIECES_VECTOR 4
#endif
#ifndef FP8_PIECES_WIDTH
#define FP8_PIECES_WIDTH 8
#endif
#ifndef DRAFT_MAX_HD
#define DRAFT_MAX_HD 256
#endif
