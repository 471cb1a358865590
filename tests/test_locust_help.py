"""The locustfile's options are discoverable: ``python -m loadtest.locustfile --help`` prints Locust's
help with the "kvroute multi-turn chat" group (``locust -f FILE --help`` cannot: Locust answers
--help before importing the file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_module_help_lists_locust_and_kvroute_options() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.locustfile", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "--headless" in out  # Locust's own options
    group = out.split("kvroute multi-turn chat:")[1]
    for option in (
        "--workload {ladder,mooncake,agentic}",
        "--model",
        "--session-header",
        "--first-prompt-tokens",
        "--turns",
        "--trace ",
        "--trace-limit",
        "--trace-token-scale",
        "--think-scale",
        "--max-prompt-tokens",
        "--no-stream",
    ):
        assert option in group, option
