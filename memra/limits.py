"""The design constants of memra: one home each.

    from memra.limits import VERIFY_CAP, MAX_K, spec_context

The exact class (DESIGN.md section 2) covers walks of 1..VERIFY_CAP rows; a speculative round
verifies the anchor plus K drafts, so K <= MAX_K. Everything that sizes a cache for a request
asks `spec_context` / `round_fits`, so the rule lives here and nowhere else.
"""

from __future__ import annotations

VERIFY_CAP = 15            # verify rows per walk: K + 1 <= 15, the decode-exact design constant
MAX_K = VERIFY_CAP - 1     # drafts per round
SPEC_CONTEXT_SLACK = 8     # positions a speculative request keeps beyond prompt + tokens + K
MIN_SESSION_ROOM = 4       # a session needs the prompt plus this much to run one round
PRIME_CHUNK = 8192         # prompt rows per prefill walk: a longer prompt walks in chunks, which
                           # bounds its transient buffers (activations, pieces, scores) by this
MOE_ROWS = 4096            # prompt rows per routed-experts pass (CUDA prime class)
ATTEND_BYTES = 2 << 30     # scores (float32) and probability pieces one prompt attention chunk may
                           # hold, and one pass of heads' expanded keys and values (the per-head form)
ATTEND_ROWS = 256          # rows per prompt attention chunk at most: a chunk scores up to its last
                           # row's context, so short chunks waste little of the causal triangle
HEAD_ROWS = 512            # the same for the per-head form, whose GEMMs take a chunk's rows of ONE
                           # head: at 256 they were bound by reading their operands (bench, H200:
                           # 512 rows 12.4 ms against 256's 13.4 for a 4096-token prompt's attention)
LONG_LIST = 1024           # DSA selection lists this long or longer score on a wider CUDA tile
                           # (backend/cuda/mla.py, same bits): walks from the position where
                           # every list is this long are captured apart from the shorter ones


def spec_context(prompt_len: int, max_new_tokens: int, k: int) -> int:
    """max_ctx a speculative request of this shape needs: its prompt, its tokens, one round's
    overshoot (k drafts) and a little slack for the anchor and the bonus."""
    return prompt_len + max_new_tokens + k + SPEC_CONTEXT_SLACK


def round_fits(pos: int, k: int, max_ctx: int) -> bool:
    """Whether a round of k drafts (k + 1 verify rows, and the bonus after them) fits a cache at
    position pos."""
    return pos + k + 2 <= max_ctx
