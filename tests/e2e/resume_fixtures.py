"""Reward functions tests/e2e/test_resume.py names by dotted path (the CLI runs from the repo root)."""


def exploding_reward(response: str, answer, *, response_ids: list[int]) -> float:
    """A reward on the wrong scale: 1e34 for odd-length responses. Without std normalization the
    advantages are ~1e34; the loss stays finite but its gradient norm overflows float32."""
    return 1e34 if len(response_ids) % 2 else 0.0
