class ToolError(Exception):
    """A tool could not do what was asked; the message goes back to the model as the result."""
