"""The grader library: grader configs, their semantics and the resources they use (no HTTP, no SQL)."""
