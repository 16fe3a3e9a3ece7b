"""The `dali` marker is enforced: a test that builds a DALI pipeline without it fails, wherever it builds."""

from __future__ import annotations

import re
import textwrap

from tests.helpers import run_script

INNER = textwrap.dedent(
    """
    import subprocess, sys
    import pytest

    BUILD = '''
    from nvidia.dali import fn, pipeline_def
    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def numbers():
        return fn.random.uniform(range=[0, 1], shape=[2])
    numbers().build()
    '''

    @pytest.fixture(scope="module")
    def shared():
        exec(BUILD, {})

    def test_builds_in_a_child():
        subprocess.run([sys.executable, "-c", BUILD], check=True)

    def test_builds_here():
        exec(BUILD, {})

    def test_through_a_shared_fixture(shared):
        pass

    @pytest.mark.dali
    def test_marked(shared):
        exec(BUILD, {})

    @pytest.mark.no_dali
    def test_marked_once():
        exec(BUILD, {})

    def test_builds_nothing():
        pass
    """
)


def test_an_unmarked_test_that_builds_a_pipeline_fails(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    options = ["-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-n", "0", "-o", "addopts="]
    result = run_script(
        "pytest", *options, "--rootdir", str(tmp_path), "test_inner.py", cwd=tmp_path, prefix=["-m"]
    )
    out = result.stdout + result.stderr
    assert re.search(r"\b6 passed\b.* 3 errors", out), out[-3000:]  # the errors: in the tests' teardown
    for name in ("test_builds_in_a_child", "test_builds_here", "test_through_a_shared_fixture"):
        assert f"ERROR test_inner.py::{name} - Failed: this test builds" in out, out[-3000:]
    assert "(through the shared fixture shared)" in out
