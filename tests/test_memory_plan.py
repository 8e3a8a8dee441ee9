"""The memory plan (memra/memory_plan.py): bytes per device before anything is allocated, and a
refusal that names what would fit.

The plan's numbers are checked against counts made another way: the bytes a model really holds
(the arrays a backend keeps, walked layer by layer), the bytes a fixture file really stores, and a
safetensors file written here by hand. The `full` preset (GLM-5-Next as released) is planned and
printed with no weights, and its tensor census is checked against the release's own counts.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import struct

import numpy as np
import pytest

from memra import memory
from memra.backend.numpy_ref import NumpyBackend
from memra.checkpoint import expected_tensors, load_checkpoint
from memra.cli import main as cli_main
from memra.config import ModelConfig, preset
from memra.errors import InputError
from memra.memory_plan import (
    balanced_split, checkpoint_weight_bytes, plan_for_checkpoint, plan_for_config,
)
from memra.model.trunk import Glm5Model

GIB = 2**30
H200_FREE = 140 * GIB        # what one H200 offers a process (nvidia-smi: 143771 MiB, less the context)


def cfg_of(name: str) -> ModelConfig:
    return ModelConfig.from_dict(preset(name))


# ---- what a model really holds ------------------------------------------------------------

class HeldBackend(NumpyBackend):
    """Holds weights the way the CUDA backend does (bf16 matrices raw, every other tensor float32),
    so the arrays a model keeps can be counted on the CPU."""

    def matrix(self, a):
        return a if a.dtype == np.uint16 else np.ascontiguousarray(a, dtype=np.float32)


def held_arrays(obj, seen: set) -> dict:
    """numpy dtype name -> bytes of every array reachable from obj's attributes not yet in `seen`."""
    out: dict = {}
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            out[x.dtype.name] = out.get(x.dtype.name, 0) + x.nbytes
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif hasattr(x, "__dict__") and not isinstance(x, (NumpyBackend, ModelConfig, type)):
            stack.extend(vars(x).values())
    return out


HELD_NAMES = {"uint16": "bf16", "float32": "f32"}


def check_plan_is_what_the_model_holds(path: str) -> None:
    cfg = cfg_of("small")
    model = Glm5Model(cfg, load_checkpoint(path, cfg, keep_bf16=True), HeldBackend())
    planned = checkpoint_weight_bytes(path, cfg)
    seen: set = set()
    for i, layer in enumerate(model.layers):
        held = {HELD_NAMES[k]: v for k, v in held_arrays(layer, seen).items()}
        assert held == planned.parts[i], f"layer {i}"
    assert held_arrays(model.embed_table, seen) == {"float32": planned.embed}
    head = held_arrays([model.lm_head, model.final_norm], seen)
    assert sum(head.values()) == planned.head
    assert sum(held_arrays(model.mtp, seen).values()) == planned.mtp   # its embed and head are counted above
    assert planned.by_dtype().keys() == {"bf16", "f32"} and planned.by_dtype()["bf16"] > planned.by_dtype()["f32"]


def test_planned_weight_bytes_are_what_the_model_holds_layer_by_layer(fixture_dir):
    check_plan_is_what_the_model_holds(fixture_dir("small", dtype="bfloat16"))


def test_red_arm_a_plan_that_counts_the_embedding_as_bf16_is_caught(fixture_dir, monkeypatch):
    monkeypatch.setattr(memory, "_HELD_F32", re.compile(memory._HELD_F32.pattern.replace("^embed_tokens", "^nothing")))
    with pytest.raises(AssertionError):
        check_plan_is_what_the_model_holds(fixture_dir("small", dtype="bfloat16"))


def test_a_bf16_checkpoint_plans_like_the_bf16_release_of_its_config(fixture_dir):
    """The fixture stores every tensor BF16, the release some F32: held the same way all the same."""
    cfg = cfg_of("small")
    from_files = checkpoint_weight_bytes(fixture_dir("small", dtype="bfloat16"), cfg)
    assert from_files.parts == memory.config_weight_bytes(cfg, "bf16").parts


def data_bytes(path: str) -> int:
    """The data section of a single-file checkpoint: the file less its 8-byte length and JSON header."""
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
    return os.path.getsize(file) - 8 - header_len


def test_planned_bytes_are_the_fixture_files_data(fixture_dir):
    """Independent of the plan's code: an all-F32 file stores what the plan holds; an all-BF16 file
    stores the bf16 matrices as held and half of every widened tensor."""
    cfg = cfg_of("small")
    assert checkpoint_weight_bytes(fixture_dir("small"), cfg).total == data_bytes(fixture_dir("small"))
    assert memory.config_weight_bytes(cfg, "f32").total == data_bytes(fixture_dir("small"))
    held = checkpoint_weight_bytes(fixture_dir("small", dtype="bfloat16"), cfg).by_dtype()
    assert held["bf16"] + held["f32"] // 2 == data_bytes(fixture_dir("small", dtype="bfloat16"))


def test_layer_weight_bytes_group_every_contract_tensor_by_layer():
    cfg = cfg_of("small")
    by_layer = [0] * cfg.num_hidden_layers
    for name, shape in expected_tensors(cfg).items():
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) < cfg.num_hidden_layers:
            by_layer[int(parts[1])] += int(np.prod(shape)) * 4
    assert memory.layer_weight_bytes(cfg, 4) == by_layer
    wb = memory.config_weight_bytes(cfg, "f32")
    assert wb.total == sum(int(np.prod(s)) * 4 for s in expected_tensors(cfg).values())
    assert wb.embed == cfg.vocab_size * cfg.hidden_size * 4 and wb.mtp > 0
    assert memory.layer_weight_bytes(cfg, "fp8") == memory.layer_weight_bytes(cfg, 1) < by_layer


# ---- FP8 accounting from a header written by hand --------------------------------------------

def write_safetensors_by_hand(path, tensors: dict) -> None:
    """name -> (dtype, shape, bytes per element): a header and zero bytes, nothing else."""
    header, offset = {}, 0
    for name, (dtype, shape, width) in tensors.items():
        n = int(np.prod(shape)) * width
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def check_fp8_header(tmp_path) -> None:
    cfg = cfg_of("small")
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    write_safetensors_by_hand(tmp_path / "model.safetensors", {
        q_b: ("F8_E4M3", (300, 130), 1),
        q_b + "_scale_inv": ("F32", (3, 2), 4),           # ceil(300/128) x ceil(130/128) blocks
        "model.layers.1.self_attn.kv_b_proj.weight": ("BF16", (64, 32), 2),
        "model.layers.1.hc_attn_base": ("F32", (24,), 4),
        "model.embed_tokens.weight": ("BF16", (256, 64), 2),
    })
    wb = checkpoint_weight_bytes(str(tmp_path), cfg)
    assert wb.parts[1] == {"fp8": 300 * 130, "fp8_scale": 3 * 2 * 4, "bf16": 64 * 32 * 2, "f32": 24 * 4}
    assert wb.parts["embed"] == {"f32": 256 * 64 * 4}    # the embedding table is held widened
    assert plan_for_checkpoint(str(tmp_path), cfg, max_ctx=16).dtype == "fp8"


def test_an_f8_e4m3_tensor_counts_one_byte_plus_its_f32_block_scales(tmp_path):
    check_fp8_header(tmp_path)


def test_red_arm_a_plan_blind_to_scale_siblings_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "SCALE_SUFFIX", "_scale")
    with pytest.raises(AssertionError):
        check_fp8_header(tmp_path)


def test_the_fp8_release_split_follows_the_research_notes():
    """FP8: DSA/MTP q_a, q_b, kv_a, o_proj, dense MLP, experts; BF16: kv_b_proj, KDA o_proj, the rest."""
    cfg = cfg_of("small")
    dtypes = memory.release_dtypes(cfg, "fp8")
    dsa, kda, n = cfg.dsa_layers[0], cfg.kda_layers[0], cfg.num_hidden_layers
    fp8 = {k for k, (d, _) in dtypes.items() if d == "F8_E4M3"}
    assert f"layers.{dsa}.self_attn.o_proj.weight" in fp8 and f"layers.{kda}.self_attn.o_proj.weight" not in fp8
    assert f"layers.{dsa}.self_attn.kv_b_proj.weight" not in fp8 and f"layers.{n}.self_attn.q_b_proj.weight" in fp8
    assert "layers.0.mlp.down_proj.weight" in fp8 and "layers.1.mlp.experts.7.up_proj.weight" in fp8
    assert not any(".indexer." in k or k.endswith("mlp.gate.weight") for k in fp8)
    for name in fp8:
        out, inp = dtypes[name][1]
        assert dtypes[name + "_scale_inv"] == ("F32", (-(-out // 128), -(-inp // 128)))


# ---- the released model, planned without weights ------------------------------------------

def check_release_counts(config: dict) -> None:
    dtypes = memory.release_dtypes(ModelConfig.from_dict(config), "fp8")
    scales = sum(k.endswith("_scale_inv") for k in dtypes)
    assert scales == 37338 and len(dtypes) + 347 == 76108


def test_the_full_preset_matches_the_release_tensor_counts():
    """research/glm5_checkpoint.md: the FP8 release holds 76,108 keys, 37,338 of them scales, and
    347 vision tensors memra ignores."""
    check_release_counts(preset("full"))


def test_red_arm_a_full_preset_with_one_dense_layer_is_caught():
    with pytest.raises(AssertionError):
        check_release_counts({**preset("full"), "mlp_layer_types": ["dense"] + ["sparse"] * 44})


def test_the_full_plan_needs_several_h200s_and_fp8_halves_the_weights():
    cfg = cfg_of("full")
    bf16 = plan_for_config(cfg, "bf16", max_ctx=131072, free=H200_FREE, source="preset full")
    fp8 = plan_for_config(cfg, "fp8", max_ctx=131072, free=H200_FREE, source="preset full")
    print("\n" + bf16.describe() + "\n" + fp8.describe())
    assert bf16.weights.total > 141e9 and not bf16.fits
    assert 0.45 < fp8.weights.total / bf16.weights.total < 0.55
    need_bf16, need_fp8 = bf16.devices_needed(), fp8.devices_needed()
    assert need_fp8 < need_bf16
    with pytest.raises(InputError, match=rf"needs {need_bf16} GPUs \(--gpus {need_bf16}\)") as refusal:
        bf16.check()
    assert f"FP8 weights ({memory_size(fp8.weights.total)}) on {need_fp8} devices" in str(refusal.value)
    split = plan_for_config(cfg, "fp8", max_ctx=131072, devices=need_fp8, free=H200_FREE)
    print(split.describe())
    assert split.fits and not plan_for_config(cfg, "fp8", max_ctx=131072, devices=need_fp8 - 1, free=H200_FREE).fits
    assert [d.first for d in split.devices][0] == 0 and split.devices[-1].stop == 45
    assert "embed" in split.devices[0].groups and {"head", "mtp", "embed"} <= set(split.devices[-1].groups)


def memory_size(n: int) -> str:
    from memra.memory_plan import size
    return size(n)


# ---- refusals name the fix, and the fix is exact ----------------------------------------------

def test_a_too_long_context_is_refused_with_the_largest_max_ctx_that_fits():
    cfg = cfg_of("small")
    at_100 = plan_for_config(cfg, "bf16", max_ctx=100)
    free = at_100.devices[0].total          # exactly 100 positions fit
    with pytest.raises(InputError, match=r"max_ctx 100 or less \(--max-ctx 100\)"):
        plan_for_config(cfg, "bf16", max_ctx=5000, free=free).check()
    assert plan_for_config(cfg, "bf16", max_ctx=100, free=free).fits
    assert not plan_for_config(cfg, "bf16", max_ctx=101, free=free).fits


def test_weights_that_fit_only_as_fp8_are_refused_naming_fp8():
    cfg = cfg_of("bench")
    fp8_total = plan_for_config(cfg, "fp8", max_ctx=1024).devices[0].total
    with pytest.raises(InputError, match=r"FP8 weights \(.*\) fit on 1 device; .*needs 2 GPUs"):
        plan_for_config(cfg, "bf16", max_ctx=1024, free=fp8_total).check()
    assert plan_for_config(cfg, "fp8", max_ctx=1024, free=fp8_total).fits


def test_a_cuda_plan_counts_a_prompts_transient_buffers():
    """graphs=True (the CUDA backend) adds a prompt walk's working set to each device's buffers:
    the rows stop growing at PRIME_CHUNK, the attention's key and value copies grow with the span,
    and a device of KDA layers with dense MLPs counts neither experts nor attention."""
    from memra.limits import PRIME_CHUNK
    from memra.memory_plan import graph_buffer_bytes
    from memra.schedules import KDA

    cfg = cfg_of("bench")
    cuda, host = (plan_for_config(cfg, "bf16", max_ctx=4096, graphs=g).devices[0] for g in (True, False))
    prime = memory.prime_buffer_bytes(cfg, range(cfg.num_hidden_layers), 4096)
    assert cuda.buffers - host.buffers == graph_buffer_bytes(cfg) + prime
    full = cfg_of("full")
    at = lambda ctx: memory.prime_buffer_bytes(full, range(full.num_hidden_layers), ctx)
    span = 1 << 19  # past PRIME_CHUNK both ways: only the attention's span term moves
    assert abs(at(2 * span) - at(span) - memory.PRIME_MARGIN * 24 * full.kv_lora_rank * span) <= 1
    assert at(PRIME_CHUNK) > at(PRIME_CHUNK // 2) > 0
    first = 0
    assert cfg.layer_types[first] == KDA and cfg.mlp_layer_types[first] == "dense"
    rows, d, c = PRIME_CHUNK, cfg.hidden_size, cfg.linear_dim
    want = memory.PRIME_MARGIN * (rows * (2 * cfg.hc_mult + 6) * d * 4 + 11 * rows * c * 4)
    assert abs(memory.prime_buffer_bytes(cfg, [first], PRIME_CHUNK) - want) <= 1


def test_one_device_plan_agrees_with_the_cache_check():
    """Without graph buffers, one device's cache + buffers is memra.memory.cache_bytes at max_ctx."""
    cfg = cfg_of("small")
    per_pos, fixed = memory.cache_bytes(cfg)
    d = plan_for_config(cfg, "bf16", max_ctx=777, graphs=False).devices[0]
    assert d.cache + d.buffers == fixed + per_pos * 777


def check_split(layers: tuple, n: int, split) -> None:
    wb = memory.WeightBytes({**{i: {"f32": b} for i, b in enumerate(layers)},
                             "embed": {"f32": 4}, "head": {"f32": 3}}, len(layers))
    load = lambda first, stop: sum(layers[first:stop]) + (4 if first == 0 else 0) + (3 if stop == len(layers) else 0)
    got = split(wb, n)
    best = min(max(load(a, b) for a, b in zip((0,) + cuts, cuts + (len(layers),)))
               for cuts in itertools.combinations(range(1, len(layers)), n - 1))
    assert [r[0] for r in got][0] == 0 and got[-1][1] == len(layers)
    assert all(a < b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(n - 1))
    assert max(load(a, b) for a, b in got) == best


@pytest.mark.parametrize("layers, n", [((5, 1, 1, 1, 9, 2, 2), 3), ((1, 1, 1, 1, 1, 1), 4), ((3, 8, 2), 3)])
def test_the_split_minimises_the_fullest_device(layers, n):
    check_split(layers, n, balanced_split)


def test_red_arm_an_even_layer_count_split_is_caught():
    def even(wb, n):
        cuts = [round(i * wb.num_layers / n) for i in range(n + 1)]
        return list(zip(cuts, cuts[1:]))
    with pytest.raises(AssertionError):
        check_split((9, 1, 1, 1, 1, 1, 1), 2, even)


def test_more_devices_than_layers_is_refused():
    with pytest.raises(InputError, match="7 devices for 6 layers"):
        plan_for_config(cfg_of("small"), devices=7)


# ---- the command line ---------------------------------------------------------------------

def test_cli_plan_prints_the_full_model_and_refuses_naming_the_gpus(monkeypatch, capsys):
    monkeypatch.setattr(memory, "free_bytes", lambda be: H200_FREE)
    code = cli_main.main(["--plan", "--preset", "full", "--weights-dtype", "fp8", "--max-ctx", "131072",
                          "--backend", "numpy", "--json"])
    out, err = capsys.readouterr()
    need = plan_for_config(cfg_of("full"), "fp8", max_ctx=131072, free=H200_FREE).devices_needed()
    assert code == 2 and f"needs {need} GPUs" in err and err.count("\n") == 1
    record = json.loads(out.splitlines()[-1])
    assert record["fits"] is False and record["dtype"] == "fp8" and record["max_ctx"] == 131072
    assert out.startswith("memory plan for preset full: fp8 weights")


def test_cli_plan_of_a_checkpoint_that_fits_exits_0(fixture_dir, capsys):
    code = cli_main.main(["--plan", "--checkpoint", fixture_dir("small"), "--max-ctx", "64", "--backend", "numpy"])
    out, _ = capsys.readouterr()
    assert code == 0 and "max_ctx 64" in out and ": fits" in out


@pytest.mark.parametrize("argv, fix", [(["--preset", "full"], "give --plan too"),
                                       (["--plan", "--weights-dtype", "fp8"], "give --preset NAME")])
def test_cli_plan_flags_out_of_place_are_refused(argv, fix, capsys):
    assert cli_main.main(argv) == 2
    assert fix in capsys.readouterr().err


def test_a_run_reports_its_plan_in_the_summary_and_json(fixture_dir, capsys):
    code = cli_main.main(["--checkpoint", fixture_dir("small"), "--prompt-ids", "1,2,3", "-n", "2", "--draft", "none",
                          "--backend", "numpy", "--json"])
    out, err = capsys.readouterr()
    plan = json.loads(out.splitlines()[-1])["memory_plan"]
    assert code == 0 and plan["max_ctx"] == 3 + 2 and plan["devices"] == 1 and plan["fits"]
    weights = checkpoint_weight_bytes(fixture_dir("small"), cfg_of("small"))
    assert plan["per_device"][0]["weights_total"] == weights.total
    assert "memory plan: f32 weights, max_ctx 5" in err


# ---- on the device ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_the_plan_is_what_the_device_allocates(fixture_dir, dtype):
    """Weights and cache planes on a CUDA device, counted by CuPy's pool, against the plan (each
    allocation rounds up to 512 bytes)."""
    cp = pytest.importorskip("cupy")
    import memra

    path = fixture_dir("small", dtype=dtype)
    gc.collect()  # earlier tests' unreachable arrays would leave the pool mid-count
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    model = memra.load_model(path, backend="cuda")
    cp.cuda.Device().synchronize()
    loaded = pool.used_bytes() - before
    plan = plan_for_checkpoint(path, model.cfg, max_ctx=512, graphs=False)
    allocations = 2 * len(expected_tensors(model.cfg))   # at most: every tensor, and each FP8 one's scales
    assert abs(loaded - plan.weights.total) <= 512 * allocations, (loaded, plan.weights.total)
    before = pool.used_bytes()
    cache = model.new_cache(512)
    mtp_plane = model.mtp.new_plane(512)  # the plan counts it: a native-mtp session makes it beside the cache
    model._new_snapshots(model.layers, cache)  # and the KDA snapshots a verify walk makes
    made = pool.used_bytes() - before
    assert plan.devices[0].cache <= made <= plan.devices[0].cache + plan.devices[0].buffers + 512 * 64, (made, plan)
    free = model.be.free_bytes()
    assert isinstance(free, int) and 0 < free <= cp.cuda.runtime.memGetInfo()[1]
    del cache, mtp_plane


@pytest.mark.parametrize("source", [["--preset", "small"], ["--checkpoint", "small"]])
def test_cli_plan_follows_an_explicit_stage_split(fixture_dir, capsys, source):
    if source[0] == "--checkpoint":
        source = ["--checkpoint", fixture_dir("small")]
    code = cli_main.main(["--plan", *source, "--stage-layers", "0-0,1-5", "--backend", "numpy", "--json"])
    out, err = capsys.readouterr()
    record = json.loads(out.splitlines()[-1])
    assert code == 0, err
    assert record["devices"] == 2 and [d["layers"] for d in record["per_device"]] == [[0, 1], [1, 6]]
