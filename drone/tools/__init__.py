"""The drone's built-in tools. Each takes the work order's abort signal; all stay inside the
drone's work directory."""

from .errors import ToolError
from .toolbox import Toolbox

__all__ = ["ToolError", "Toolbox"]
