import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py


@pytest.fixture(scope="session")
def embedded_target():
    """The real SmolLM2-135M target (converted from its GGUF once per machine, then cached)."""
    from domino.target import Target

    return Target.load("smollm2-135m")
