"""The README's install and test commands are the ones CI runs, so a missing install step fails CI."""

from __future__ import annotations

import re


def readme_commands(repo_root) -> list[str]:
    text = (repo_root / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("pip ")
    ]


def test_ci_runs_the_readme_commands(repo_root):
    commands = readme_commands(repo_root)
    assert len(commands) >= 2, commands
    ci_script = (repo_root / ".ci" / "run").read_text()
    for command in commands:
        assert command in ci_script, f"README command not run by .ci/run: {command}"


def test_install_pins_the_cpu_torch(repo_root):
    pyproject = (repo_root / "pyproject.toml").read_text()
    assert '"torch==2.13.0"' in pyproject
