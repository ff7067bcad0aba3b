"""Errors megarl raises for bad input. Each says what is wrong and how to fix it."""


class MegarlError(Exception):
    """Base class: the CLI prints the message (no traceback) and exits with code 2 (or the error's ``exit_code``)."""


class ConfigError(MegarlError):
    """A config file or override is invalid (unknown key, wrong type, inconsistent sizes)."""


class CheckpointError(MegarlError):
    """A checkpoint is missing, corrupt or does not match the model."""


class InputError(MegarlError):
    """A prompt, dataset or request is invalid (e.g. longer than the model's context)."""


class EngineError(MegarlError):
    """A rollout engine failed to start, died, or refused a request."""


class TrainingError(MegarlError):
    """Training cannot go on (e.g. too many consecutive steps with a non-finite loss or gradient norm)."""


class RewardError(TrainingError):
    """Too many reward calls fail: the reward function or the data is broken (the error shows one failure)."""


class AgentError(TrainingError):
    """Too many agent episodes fail: the agent (agent.fn, agent.command or the agent service) is broken or past
    its limits (the error names it and shows one failure)."""


class ScorerError(TrainingError):
    """A strategy's scoring process (the dedicated scorer) died, hung up or did not answer in time."""
