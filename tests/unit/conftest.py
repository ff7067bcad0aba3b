"""Real HF tokenizers for the unit tests, written from the tiny model YAMLs' ``tokenizer:`` sections; and the
process-wide stop state reset around every test."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_stop_state():
    """The stop budget and the signal latch are one per process (megarl/stop_protocol.py): a test that asks a
    run to stop starts them, and a later test in the same process would find restarts refused and waits cut
    short. Every unit test starts and ends with them fresh, whatever ran before it in its process."""
    from megarl.stop_protocol import early_stop, stop_budget

    def fresh():
        stop_budget.reset()
        early_stop.reset()

    fresh()
    yield
    fresh()


def write_tokenizer(model_yaml: str, out: Path) -> Path:
    from megarl.models.tiny_tokenizer import TinyTokenizer

    fields = yaml.safe_load((ROOT / model_yaml).read_text())
    TinyTokenizer(fields["tokenizer"], fields, where=model_yaml).save(out)
    return out


def run_tokenizer(path: Path, **data_overrides):
    """megarl's RunTokenizer over ``path`` with the default data/rollout settings (overridable)."""
    from megarl.config.schema import DataConfig, ModelConfig, RolloutConfig
    from megarl.tokenizer import RunTokenizer

    data = DataConfig(**data_overrides)
    return RunTokenizer.load(ModelConfig(checkpoint=str(path)), RolloutConfig(), data)


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory):
    """The demo's tokenizer: digits, newline, ChatML markers; EOS ids <|im_end|>=2 and <|endoftext|>=0."""
    return write_tokenizer("configs/models/tiny_qwen3.yaml", tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="session")
def text_tokenizer_dir(tmp_path_factory):
    """The character-level tokenizer over printable ASCII (configs/models/tiny_qwen3_text.yaml)."""
    return write_tokenizer("configs/models/tiny_qwen3_text.yaml", tmp_path_factory.mktemp("text_tok"))


@pytest.fixture
def demo_tokenizer(demo_tokenizer_dir):
    return run_tokenizer(demo_tokenizer_dir)


@pytest.fixture
def text_tokenizer(text_tokenizer_dir):
    return run_tokenizer(text_tokenizer_dir)


#: ids of the demo tokenizer (configs/models/tiny_qwen3.yaml): specials, words, then characters
DEMO = SimpleNamespace(ENDOFTEXT=0, IM_START=1, IM_END=2, USER=3, ASSISTANT=4, NEWLINE=16)


def digits(s: str) -> list[int]:
    """Demo-tokenizer ids of a digit string."""
    return [6 + int(c) for c in s]


def chat_prompt(s: str) -> list[int]:
    """Demo-tokenizer ids of ``s`` as one user message with the generation prompt (ChatML)."""
    d = DEMO
    return [d.IM_START, d.USER, d.NEWLINE, *digits(s), d.IM_END, d.NEWLINE, d.IM_START, d.ASSISTANT, d.NEWLINE]
