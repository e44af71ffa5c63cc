import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

# Tiny test models run fastest on one thread, and a second thread only adds contention when other
# processes (Ray workers, replicas) share the machine's cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def embedded_target():
    """The real SmolLM2-135M target (converted from its GGUF once per machine, then cached)."""
    from domino.target import Target

    return Target.load("smollm2-135m")
