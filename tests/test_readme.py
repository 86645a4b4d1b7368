"""The README's commands: its test command is what CI runs, its CLI commands parse, its first example runs."""

import pathlib
import re
import shlex

import pytest
import torch

from autoragged import report, tune

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, split as a shell would (comments dropped)."""
    lines = [line for block in _blocks("bash") for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_the_test_command_is_the_last_line_of_ci():
    section = README.split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    (block,) = _blocks("bash", section)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert block.splitlines() == [ci[-1]]


@pytest.mark.parametrize("module, parser", [("autoragged.tune", tune._parser), ("autoragged.report", report._parser)])
def test_cli_commands_in_the_readme_parse(module, parser):
    commands = [c[3:] for c in _commands() if c[:3] == ["python", "-m", module]]
    assert commands, f"the README shows no `python -m {module}` command"
    for args in commands:
        parser().parse_args(args)  # an unknown or malformed option exits (SystemExit fails the test)


def test_the_first_example_runs_and_pads_with_zeros(monkeypatch):
    """On CPU, with the reference ops (the interpreter is for kernel tests: far too slow for 6 layers)."""
    from autoragged import ops
    from autoragged.ragged import tensor as _ragged

    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(_ragged, "use_triton", lambda t: False)
    scope: dict = {}
    exec(_blocks("python")[0], scope)
    model, x, lengths, y = scope["model"], scope["x"], scope["lengths"], scope["y"]
    assert y.shape == x.shape
    mask = torch.arange(x.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    assert not y[mask].any()  # padding rows are zeros
    autoragged = scope["autoragged"]
    autoragged.unwrap(model)
    with torch.inference_mode():
        expected = model(x, src_key_padding_mask=mask)
    torch.testing.assert_close(y[~mask], expected[~mask], rtol=1e-4, atol=1e-4)
    # whichever arm the prior picked above, the other one keeps the same promise
    for policy in ("padded", "ragged"):
        with torch.inference_mode():
            forced = autoragged.wrap(model, policy=policy)(x, lengths=lengths)
        assert autoragged.recent_decisions(model, 1)[0].arm == policy
        assert not forced[mask].any()
        torch.testing.assert_close(forced[~mask], expected[~mask], rtol=1e-4, atol=1e-4)
        autoragged.unwrap(model)
