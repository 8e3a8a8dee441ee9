"""docs/plugins.md: every hook and its arguments are documented, every Python block compiles,
and the tutorial's plugin works as written (registered on the manager, byte-identical tape)."""

import inspect
import re
import types
from pathlib import Path

import pytest

from memra import load_model
from memra.drafters import hookspecs, registry
from memra.generate import generate

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "plugins.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.DOTALL)
HOOKS = [fn for name, fn in vars(hookspecs).items() if name.startswith("memra_") and callable(fn)]


def test_hookspecs_are_found():
    assert [fn.__name__ for fn in HOOKS] == ["memra_register_draft_sources"]
    assert all(hasattr(fn, f"{hookspecs.PROJECT}_spec") for fn in HOOKS)


@pytest.mark.parametrize("hook", HOOKS, ids=lambda fn: fn.__name__)
def test_every_hook_and_argument_is_documented(hook):
    args = ", ".join(inspect.signature(hook).parameters)
    assert f"### `{hook.__name__}({args})`" in DOC


@pytest.mark.parametrize("hook", HOOKS, ids=lambda fn: fn.__name__)
def test_every_hook_has_a_test(hook):
    tests = (ROOT / "tests" / "drafters" / "test_registry.py").read_text()
    assert f"def test_hook_{hook.__name__}" in tests


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_tutorial_python_blocks_compile(index):
    compile(PYTHON_BLOCKS[index], f"docs/plugins.md block {index}", "exec")


def test_the_tutorial_plugin_keeps_the_plain_tape(fixture_dir, monkeypatch):
    monkeypatch.delenv(registry.ALLOW_LIST_ENV, raising=False)
    (source,) = [block for block in PYTHON_BLOCKS if "@memra.hookimpl" in block]
    plugin = types.ModuleType("memra_repeat")
    exec(compile(source, "memra_repeat.py", "exec"), plugin.__dict__)
    registry.reset_registry()
    registry.plugin_manager().register(plugin, name="memra-repeat")
    try:
        model = load_model(fixture_dir("mini"), backend="numpy")
        plain = generate(model, [1, 2, 3, 4, 5, 6], 32)
        spec = generate(model, [1, 2, 3, 4, 5, 6], 32, draft="repeat", num_draft_tokens=4)
        assert spec.tokens == plain.tokens and spec.stats["num_accepted_tokens"] > 0
    finally:
        registry.reset_registry()
