"""Errors a tool raises on purpose."""


class ToolError(Exception):
    """A mistake the model made (unknown id, refused action): the model reads `Error: <message>`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ToolUnavailable(Exception):
    """The tool's own infrastructure failed (a sandbox that cannot start, a backend that is down).

    Not the model's fault and not a bug: the call answers 503 with `Retry-After`, so the trainer
    retries it and, if the fault persists, discards the rollout instead of training on it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class GradingConfigError(Exception):
    """A grader cannot score a rollout because of how it was set up, not because of the model.

    The dataset row lacks what the grader needs (a state check's task id, a field a template reads)
    or the grader's settings do not fit it. Raised from a state check, it fails the grade: the trainer
    gets an error (and drops the rollout) instead of a score of 0 it would train on.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ToolDefinitionError(TypeError):
    """A tool's signature cannot be served; raised when the tool is defined, not when it is called."""


class StateGone(Exception):
    """A state check needs part of the rollout's state that no longer exists (the rollout's live
    interpreter stopped, was evicted or lives in another process), so it cannot score the rollout.

    Raised from a state check, the grade is refused as one whose rollout state expired (409
    `rollout_state_gone`, nothing stored): never a score of 0 for what the model did not do.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
