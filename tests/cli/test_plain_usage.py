"""Usage errors in plain words (issue #48): a bad option value as the commands' own checks
word it, not pydantic's "Input should be ..." (typer's parsing), and an empty ROOT refused
rather than read as the current folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import in_a_pipe


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("prune", "{root}", "--keep", "abc"),
            "invalid value for '--keep': 'abc' is not a whole number",
        ),
        (
            ("history", "{root}", "--limit", "-3"),
            "invalid value for '--limit': must be at least 0, not -3",
        ),
        (
            ("history", "{root}", "--limit", "2.5"),
            "invalid value for '--limit': '2.5' is not a whole number",
        ),
        (("inspect", "", "global_step1"), "invalid value for 'ROOT': must not be empty"),
        (("ls", " "), "invalid value for 'ROOT': must not be empty"),
    ],
)
def test_a_bad_value_is_said_in_plain_words(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    """Bugs caught: 'Input should be a valid integer, unable to parse string as an
    integer' and 'Input should be greater than or equal to 0'; `nebula inspect "" TAG`
    looking in the current folder (exit 3, "no checkpoint")."""
    run = in_a_pipe(*(a.format(root=tmp_path) for a in args))
    assert run.code == 2, (run.code, run.stderr)
    assert said in run.stderr, run.stderr
    assert "Input should" not in run.stderr and run.stdout == ""
