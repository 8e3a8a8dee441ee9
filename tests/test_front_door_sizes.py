"""Sizes declared before they are checked: an absurd config is refused before anything is
enumerated or allocated, and a context memory cannot hold is refused with the number that fits.

Hang-prone inputs run under a deadline (`within`), so a regression fails in seconds instead of
eating the machine. The memory budget is pinned by monkeypatching memra.memory's view of free
memory, so every bound here is exact and the same on any host.
"""

from __future__ import annotations

import json
import shutil

import pytest
from deadline import within

import memra
from memra import memory
from memra.checkpoint import expected_count, expected_tensors
from memra.config import MAX_LAYERS, MAX_SIZE, ModelConfig, preset
from memra.errors import CheckpointError, ConfigError, InputError

SCHEDULE_KEYS = ("layer_types", "mlp_layer_types", "indexer_types", "first_k_dense_replace", "linear_attn_config")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def derived_schedules(**changes) -> dict:
    """The small preset with its explicit schedules dropped, so every per-layer list is derived
    from num_hidden_layers (what an absurd layer count would make memra enumerate)."""
    cfg = {k: v for k, v in preset("small").items() if k not in SCHEDULE_KEYS}
    return {**cfg, **changes}


def rewritten(src: str, dst, **changes):
    """A copy of checkpoint `src` whose config.json declares `changes` (None drops a key)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture
def budget(monkeypatch):
    """budget(n): from now on the host and the backend have exactly n bytes free."""
    def pin(n: int) -> None:
        monkeypatch.setattr(memory, "host_available_bytes", lambda: n)
        monkeypatch.setattr(memory, "free_bytes", lambda be: n)
    return pin


@pytest.fixture(scope="module")
def model(fixture_dir):
    return memra.load_model(fixture_dir("small"), backend="numpy")


# ---- config.json alone ---------------------------------------------------------------------------

def test_an_absurd_layer_count_is_refused_before_any_schedule_is_built():
    with within(2), pytest.raises(ConfigError, match=f"num_hidden_layers 1000000000 is past the bound of {MAX_LAYERS}"):
        ModelConfig.from_dict(derived_schedules(num_hidden_layers=10**9))
    assert ModelConfig.from_dict(derived_schedules(num_hidden_layers=MAX_LAYERS)).num_hidden_layers == MAX_LAYERS


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "max_position_embeddings", "n_routed_experts",
                                 "moe_intermediate_size", "index_topk", "kv_lora_rank"])
def test_every_declared_size_past_int32_is_refused_by_name(key):
    with within(2), pytest.raises(ConfigError, match=f"{key} {2**40} is past {MAX_SIZE}"):
        ModelConfig.from_dict({**preset("small"), key: 2**40})


# ---- declared sizes against the files -------------------------------------------------------------

@pytest.mark.parametrize("changes", [
    {"n_routed_experts": 10**9, "n_group": 1, "topk_group": 1},
    {"n_routed_experts": 10**6, "n_group": 1, "topk_group": 1},
    {"num_hidden_layers": MAX_LAYERS, **{k: None for k in SCHEDULE_KEYS}},
], ids=["1e9 experts", "1e6 experts", f"{MAX_LAYERS} layers"])
def test_a_config_declaring_far_more_tensors_than_the_files_is_refused_before_enumerating(
        fixture_dir, tmp_path, changes):
    d = rewritten(fixture_dir("small"), tmp_path / "ckpt", **changes)
    with within(5), pytest.raises(CheckpointError) as info:
        memra.load_model(d, backend="numpy")
    message = str(info.value)
    assert "declares" in message and "the checkpoint files hold 328" in message and "\n" not in message
    key = "n_routed_experts" if "n_routed_experts" in changes else "num_hidden_layers"
    assert f"{key} {changes[key]}" in message


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": False}, {"num_nextn_predict_layers": 0},
                                     {"index_topk_freq": 2, "indexer_types": None},
                                     {"mlp_layer_types": ["dense"] * 6, "first_k_dense_replace": None}])
@pytest.mark.parametrize("name", ["mini", "small", "bench"])
def test_the_closed_form_tensor_count_equals_the_contract(name, changes):
    raw = {**preset(name), **changes}
    cfg = ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None and
                                 not (k == "mlp_layer_types" and len(v) != raw["num_hidden_layers"])})
    assert expected_count(cfg) == len(expected_tensors(cfg))


def test_weights_past_the_free_host_memory_are_refused_before_reading(fixture_dir, budget):
    path = fixture_dir("small")
    budget(1 << 20)
    with within(5), pytest.raises(CheckpointError, match=r"GiB of weights .* but the host has 0\.00 GiB available"):
        memra.load_model(path, backend="numpy")
    budget(1 << 40)
    assert memra.load_model(path, backend="numpy").cfg.vocab_size == 256


# ---- a cache and a request against memory ----------------------------------------------------------

def test_new_cache_past_free_memory_is_refused_with_the_max_ctx_that_fits(model, budget):
    per_pos, fixed = memory.cache_bytes(model.cfg)
    fits = 100
    budget(fixed + per_pos * fits)
    assert model.new_cache(fits).max_ctx == fits
    with pytest.raises(InputError, match=f"max_ctx {fits + 1} needs .* at most max_ctx {fits} fits"):
        model.new_cache(fits + 1)


def test_a_cache_of_huge_declared_walk_buffers_is_refused(fixture_dir, tmp_path, budget):
    """index_topk sizes every walk's attention buffers: checked with the cache, not at the first walk."""
    d = rewritten(fixture_dir("small"), tmp_path / "ckpt", index_topk=2**30)
    model = memra.load_model(d, backend="numpy")
    budget(1 << 30)
    with within(5), pytest.raises(InputError, match="at most max_ctx 0 fits"):
        model.new_cache(16)


@pytest.mark.parametrize("draft, k", [(None, 4), ("native-mtp", 3)])
def test_max_new_tokens_past_memory_is_refused_by_name_with_the_number_that_fits(model, budget, draft, k):
    per_pos, fixed = memory.cache_bytes(model.cfg)
    overhead = 0 if draft is None else k + 8
    room = 5
    budget(fixed + per_pos * (len(PROMPT) + room + overhead))
    with pytest.raises(InputError, match=rf"max_new_tokens={room + 1} .* give max_new_tokens <= {room}$"):
        memra.generate(model, PROMPT, room + 1, draft=draft, num_draft_tokens=k)
    assert len(memra.generate(model, PROMPT, room, draft=draft, num_draft_tokens=k, eos=()).tokens) == room


def test_max_new_tokens_past_max_position_embeddings_names_max_new_tokens(model):
    limit = model.cfg.max_position_embeddings
    with pytest.raises(InputError, match=rf"max_new_tokens={10**12} .*max_position_embeddings \({limit}\): "
                                         rf"give max_new_tokens <= {limit - len(PROMPT)}$"):
        memra.generate(model, PROMPT, 10**12)


def test_a_prompt_that_leaves_no_room_is_refused_even_for_zero_tokens(model, budget):
    per_pos, fixed = memory.cache_bytes(model.cfg)
    budget(fixed + per_pos * (len(PROMPT) - 1))
    with pytest.raises(InputError, match="leaves no room .* shorten the prompt"):
        memra.generate(model, PROMPT, 0)
