import pytest
from accelerate.state import AcceleratorState

from tests.training.helpers import TINY_MODELS, save_tiny_model, word_tokenizer


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """{"llama": folder, "gpt2": folder}: random tiny checkpoints with the word-level tokenizer."""
    tokenizer = word_tokenizer()
    return {
        family: save_tiny_model(family, tmp_path_factory.mktemp(f"tiny_{family}"), tokenizer) for family in TINY_MODELS
    }


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one state per process; a run with other mixed precision needs a fresh one."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
