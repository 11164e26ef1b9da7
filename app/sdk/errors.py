"""Errors a tool raises on purpose."""


class ToolError(Exception):
    """A mistake the model made (unknown id, refused action): the model reads `Error: <message>`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ToolDefinitionError(TypeError):
    """A tool's signature cannot be served; raised when the tool is defined, not when it is called."""
