"""The DALI line differences, as the rest of the package sees them (runs under every line: `make test`)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("nvidia.dali")

from ssd_lightning.data import dali_compat  # noqa: E402


def test_reader_shuffle_kwargs_seed_where_the_line_can():
    kwargs = dali_compat.reader_shuffle_kwargs(7)
    assert kwargs["shuffle_after_epoch"] is True
    if dali_compat.HAS_SHUFFLE_SEED:
        assert kwargs == {"shuffle_after_epoch": True, "shuffle_after_epoch_seed": 7}
    else:
        assert kwargs == {"shuffle_after_epoch": True}


def test_unseedable_shuffle_is_reported_once(monkeypatch):
    monkeypatch.setattr(dali_compat, "HAS_SHUFFLE_SEED", False)
    dali_compat._warn_fixed_shuffle_seed.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (dali_compat.DEFAULT_SHUFFLE_SEED, 7, 8, 9):
            assert dali_compat.reader_shuffle_kwargs(seed) == {"shuffle_after_epoch": True}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "cannot seed the global reshuffle" in messages[0]
    dali_compat._warn_fixed_shuffle_seed.cache_clear()


class _Pipe:
    def __init__(self, exec_dynamic: bool | None):
        if exec_dynamic is not None:
            self.exec_dynamic = exec_dynamic
        self.calls: list[tuple] = []

    def run(self, *args):
        self.calls.append(args)
        return ()


@pytest.mark.parametrize(
    ("exec_dynamic", "stream", "expected"),
    [
        (True, "s", ("s",)),  # 2.x GPU pipeline: outputs bound to torch's stream, no host sync
        (True, None, ()),  # CPU pipeline
        (False, "s", ()),  # the pipelined executor: host-synchronous outputs
        (None, "s", ()),  # DALI 1.34: no such attribute
    ],
)
def test_run_pipeline_binds_outputs_to_the_stream_only_with_the_dynamic_executor(
    exec_dynamic, stream, expected
):
    pipe = _Pipe(exec_dynamic)
    dali_compat.run_pipeline(pipe, stream)
    assert pipe.calls == [expected]
    assert dali_compat.uses_fresh_outputs(pipe) is bool(exec_dynamic)


def test_the_package_imports_nothing_line_specific_elsewhere():
    """Only dali_compat may touch APIs that differ between lines."""
    from pathlib import Path

    package = Path(dali_compat.__file__).parents[1]
    for path in package.rglob("*.py"):
        if path.name == "dali_compat.py":
            continue
        text = path.read_text(encoding="utf-8")
        for name in (
            "torch_utils",
            "shuffle_after_epoch_seed=",
            '"shuffle_after_epoch_seed"',
            ".exec_dynamic",
        ):
            assert name not in text, f"{path}: {name} belongs in dali_compat"
        assert "nvidia.dali.__version__" not in text and "dali.__version__" not in text, path
