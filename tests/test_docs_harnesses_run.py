"""The documented commands of the measurement harnesses (benchmarks/), run as printed: the rules of
``test_docs_commands_run.py``, in a workspace of its own, so that pytest-xdist runs the two files side by
side."""

from __future__ import annotations

import pytest

from tests.test_docs_commands_run import HARNESS_COMMANDS, Workspace, check_documented, workspace  # noqa: F401
from tests.test_readme_commands import Command

pytestmark = [pytest.mark.no_dali, pytest.mark.slow]


def test_there_are_harness_commands():
    assert len(HARNESS_COMMANDS) >= 10, [c.text for c in HARNESS_COMMANDS]


@pytest.mark.parametrize("command", HARNESS_COMMANDS, ids=lambda c: c.id)
def test_documented_harness_runs_as_printed(command: Command, workspace: Workspace):  # noqa: F811
    check_documented(command, workspace)
