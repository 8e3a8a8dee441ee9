"""Bad input at the model API: a memra error naming the bound, and the cache left as it was.

The model is built from random weights of `expected_tensors` shapes (no files). "Unchanged" is
checked twice: every cache plane is bit-identical to a snapshot taken before the refused call, and
the next valid decode step gives bit-identical logits to the same step on a never-refused twin.
"""

from __future__ import annotations

import numpy as np
import pytest

import memra
from memra.backend import cuda_available
from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import expected_tensors
from memra.config import ModelConfig, preset
from memra.errors import BackendError, ContextOverflowError, InputError, MemraError
from memra.model.trunk import Glm5Model

CFG = ModelConfig.from_dict(preset("small"))
VOCAB = CFG.vocab_size
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NEXT = 7
MAX_CTX = 16


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """norm-like 1-D tensors ~ 1 + 0.3 N; matrices N(0, 1/sqrt(fan_in)); the embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if name == "embed_tokens.weight":
            arr = rng.standard_normal(shape)
        elif len(shape) == 1:
            arr = 1.0 + 0.3 * rng.standard_normal(shape)
        else:
            arr = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        out[name] = arr.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def model() -> Glm5Model:
    return Glm5Model(CFG, random_weights(CFG), NumpyBackend())


def primed(model: Glm5Model, max_ctx: int = MAX_CTX, prompt=PROMPT):
    cache = model.new_cache(max_ctx)
    model.prime(prompt, cache)
    return cache


def snapshot(cache) -> dict:
    """Every counter and array of the cache, copied."""
    snap = {"pos": cache.pos, "max_ctx": cache.max_ctx}
    for i, st in cache.kda.items():
        snap[f"kda{i}"] = (np.array(st.ring, copy=True), np.array(st.state, copy=True))
    for i, plane in cache.mla.items():
        arrays = (plane.latent, plane.index_keys, plane.index_gates, plane.pool_keys)
        snap[f"mla{i}"] = (plane.length, plane.pools_ready) + tuple(
            None if a is None else np.array(a, copy=True) for a in arrays
        )
    return snap


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        for u, v in zip(x, y) if isinstance(x, tuple) else [(x, y)]:
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and u.tobytes() == v.tobytes(), f"{key} changed"
            else:
                assert u == v, f"{key}: {u!r} != {v!r}"


def assert_untouched(model: Glm5Model, cache, before: dict) -> None:
    """The refused call left `cache` exactly as a never-refused twin with the same history."""
    assert cache.pos == before["pos"]
    assert_same_snapshot(snapshot(cache), before)
    twin = model.new_cache(cache.max_ctx)
    if before["pos"]:
        model.prime(PROMPT[: before["pos"]], twin)
    if cache.pos < cache.max_ctx:
        got, want = model.decode_step(NEXT, cache), model.decode_step(NEXT, twin)
        assert got.dtype == want.dtype == np.float32
        assert got.tobytes() == want.tobytes()


def test_untouched_check_catches_a_cache_a_step_moved(model):
    """The red arm of assert_untouched: a decode step whose pos is rolled back is still caught."""
    cache = primed(model)
    before = snapshot(cache)
    model.decode_step(NEXT, cache)
    cache.pos = before["pos"]  # pos alone looks untouched; the planes are not
    with pytest.raises(AssertionError, match="changed|!="):
        assert_untouched(model, cache, before)


# ---- token ids -------------------------------------------------------------------------------

BAD_PROMPTS = [
    ("id_equal_to_vocab", [1, VOCAB, 2], rf"{VOCAB}.*vocab 0\.\.{VOCAB - 1}"),
    ("id_far_above_vocab", [10**6], rf"vocab 0\.\.{VOCAB - 1}"),
    ("negative_id", [1, -1], rf"-1.*vocab 0\.\.{VOCAB - 1}"),
    ("empty", [], "non-empty"),
    ("empty_array", np.zeros(0, dtype=np.int64), "non-empty"),
    ("floats", [1.0, 2.0], "integer"),
    ("float_array", np.array([1.5, 2.0], dtype=np.float32), "integer"),
    ("strings", ["1", "2"], "integer"),
    ("a_string", "hello", "integer|1-D"),
    ("none_inside", [1, None], "integer"),
    ("bools", [True, False], "integer"),
    ("two_d", [[1, 2], [3, 4]], "1-D"),
    ("two_d_array", np.array([[1, 2]]), "1-D"),
    ("ragged", [[1, 2], [3]], "integer|1-D"),
]


@pytest.mark.parametrize("ids,bound", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompt_is_an_input_error_and_leaves_the_cache_untouched(model, ids, bound):
    for cache in (model.new_cache(MAX_CTX), primed(model)):  # fresh, and mid-sequence
        before = snapshot(cache)
        with pytest.raises(InputError, match=bound):
            model.prime(ids, cache)
        assert_untouched(model, cache, before)


BAD_TOKENS = [
    ("equal_to_vocab", VOCAB, rf"vocab 0\.\.{VOCAB - 1}"),
    ("numpy_above_vocab", np.int64(VOCAB + 5), rf"vocab 0\.\.{VOCAB - 1}"),
    ("above_int64", 2**63, rf"vocab 0\.\.{VOCAB - 1}"),
    ("negative", -1, rf"vocab 0\.\.{VOCAB - 1}"),
    ("float", 7.0, "integer"),
    ("numpy_float", np.float32(7), "integer"),
    ("string", "7", "integer"),
    ("none", None, "integer"),
    ("bool", True, "integer"),
    ("a_list", [7], "1-D"),
    ("two_d", [[7]], "1-D"),
]


@pytest.mark.parametrize("tok,bound", [c[1:] for c in BAD_TOKENS], ids=[c[0] for c in BAD_TOKENS])
def test_bad_decode_token_is_an_input_error_and_leaves_the_cache_untouched(model, tok, bound):
    cache = primed(model)
    before = snapshot(cache)
    with pytest.raises(InputError, match=bound):
        model.decode_step(tok, cache)
    assert_untouched(model, cache, before)


def test_valid_id_kinds_are_accepted_alike(model):
    """The green twin of the refusals: list, numpy int array and numpy scalars give one answer."""
    a, b = model.new_cache(MAX_CTX), model.new_cache(MAX_CTX)
    la = model.prime(PROMPT, a)
    lb = model.prime(np.array(PROMPT, dtype=np.int32), b)
    assert la.tobytes() == lb.tobytes() and a.pos == b.pos == len(PROMPT)
    assert model.decode_step(NEXT, a).tobytes() == model.decode_step(np.int64(NEXT), b).tobytes()
    assert model.decode_step(VOCAB - 1, a).shape == (VOCAB,)  # the top id is inside the vocab


def test_bool_inside_an_int_prompt_is_an_input_error(model):
    with pytest.raises(InputError, match="integer"):
        model.prime([1, True], model.new_cache(MAX_CTX))


def test_huge_prompt_id_names_the_vocab_bound(model):
    with pytest.raises(InputError, match=rf"vocab 0\.\.{VOCAB - 1}"):
        model.prime([1, 2**70], model.new_cache(MAX_CTX))


def test_cache_of_another_model_is_an_input_error(model):
    mini = ModelConfig.from_dict(preset("mini"))
    foreign = Glm5Model(mini, random_weights(mini), NumpyBackend()).new_cache(MAX_CTX)
    with pytest.raises(MemraError):
        model.prime(PROMPT, foreign)


# ---- context bounds --------------------------------------------------------------------------

def test_prompt_longer_than_max_ctx_is_a_context_overflow(model):
    cache = model.new_cache(len(PROMPT) - 1)
    before = snapshot(cache)
    with pytest.raises(ContextOverflowError, match=f"max_ctx {len(PROMPT) - 1}"):
        model.prime(PROMPT, cache)
    assert_untouched(model, cache, before)


def test_prime_past_max_ctx_mid_sequence_is_a_context_overflow(model):
    cache = primed(model)
    before = snapshot(cache)
    too_many = [1] * (MAX_CTX - len(PROMPT) + 1)
    with pytest.raises(ContextOverflowError, match=f"max_ctx {MAX_CTX}"):
        model.prime(too_many, cache)
    assert_untouched(model, cache, before)


def test_decode_past_max_ctx_is_a_context_overflow(model):
    cache = primed(model, max_ctx=len(PROMPT) + 1)
    model.decode_step(NEXT, cache)                       # fills the last position: allowed
    assert cache.pos == cache.max_ctx
    before = snapshot(cache)
    with pytest.raises(ContextOverflowError, match=f"max_ctx {len(PROMPT) + 1}"):
        model.decode_step(NEXT, cache)
    assert_untouched(model, cache, before)


def test_prompt_exactly_max_ctx_long_is_accepted(model):
    cache = model.new_cache(len(PROMPT))
    assert model.prime(PROMPT, cache).shape == (VOCAB,)
    assert cache.pos == cache.max_ctx


@pytest.mark.parametrize("max_ctx,bound", [
    (0, "positive"), (-1, "positive"), (2.5, "integer"), (True, "integer"), ("16", "integer"), (None, "integer"),
    (CFG.max_position_embeddings + 1, f"max_position_embeddings \\({CFG.max_position_embeddings}\\)"),
])
def test_bad_max_ctx_is_an_input_error(model, max_ctx, bound):
    with pytest.raises(InputError, match=bound):
        model.new_cache(max_ctx)


def test_max_ctx_up_to_max_position_embeddings_is_accepted(model):
    assert model.new_cache(CFG.max_position_embeddings).max_ctx == CFG.max_position_embeddings
    assert model.new_cache(np.int64(1)).max_ctx == 1


# ---- load_model backends ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def mini_checkpoint(tmp_path_factory):
    write_fixture = getattr(memra.checkpoint, "write_fixture", None)
    if write_fixture is None:
        pytest.skip("memra.checkpoint.write_fixture does not exist yet: no checkpoint to load")
    return write_fixture(tmp_path_factory.mktemp("mini"), preset("mini"))


def test_cuda_backend_without_a_gpu_is_a_backend_error(mini_checkpoint):
    if cuda_available():
        pytest.skip("a usable CUDA GPU is present: backend='cuda' is legitimately available")
    with pytest.raises(BackendError, match="numpy"):
        memra.load_model(mini_checkpoint, backend="cuda")
    model = memra.load_model(mini_checkpoint, backend="numpy")  # the same checkpoint is loadable
    assert np.isfinite(model.decode_step(1, model.new_cache(4))).all()


def test_unknown_backend_is_an_input_error_listing_the_choices(mini_checkpoint):
    with pytest.raises(InputError, match=r"'bogus'.*numpy.*cuda"):
        memra.load_model(mini_checkpoint, backend="bogus")
