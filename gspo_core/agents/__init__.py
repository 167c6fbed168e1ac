"""Multi-turn episodes with tools: call formats, tools (python in the sandbox, http, mcp), the rollout loop.

This package's top level imports no torch (the API validates ``tools`` through `gspo_core.agents.tools`);
the loop is `gspo_core.agents.episodes`; a user's own agent is its environment through
`gspo_core.agents.remote`.
"""

from gspo_core.agents.formats import FORMATS, ToolCall, pick_format
from gspo_core.agents.tools import Toolbox, ToolResult, ToolSpecError, build_toolbox

__all__ = ["FORMATS", "ToolCall", "ToolResult", "ToolSpecError", "Toolbox", "build_toolbox", "pick_format"]
