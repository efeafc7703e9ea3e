"""Starting and stopping the runtime on a Ray cluster: the command never imports Ray itself, it runs
``python -m resource_manager.launch``, the runtime's only Ray driver, and reads its one-line JSON answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from command import head
from command.output import CliError


def launch(mode: str, options: dict, timeout: float) -> dict:
    """Run ``python -m resource_manager.launch MODE`` (the runtime's only Ray driver) with ``options``."""
    env = {k: v for k, v in os.environ.items() if k not in head.PRIVATE_ENV}
    try:
        proc = subprocess.run([sys.executable, "-m", "resource_manager.launch", mode], input=json.dumps(options) + "\n",
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CliError(f"the runtime did not answer `{mode}` within {timeout:.0f}s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if "error" in answer or not answer:
        text = answer.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CliError(text)
    return answer
