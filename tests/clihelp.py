"""Shared assertion for command-line tests: a user's mistake is one line on stderr and exit code 2."""


def assert_one_line_error(code: int, err: str, *phrases: str) -> None:
    """Exit code 2, exactly one non-blank stderr line starting 'tinylm: error:', no traceback, each phrase in it."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinylm: error:"), err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
