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


class ToolDefinitionError(TypeError):
    """A tool's signature cannot be served; raised when the tool is defined, not when it is called."""
