"""The tool registry served over the Model Context Protocol (Streamable HTTP at /mcp, and stdio)."""
