"""A small demonstration pack: stateless echo and a per-rollout notebook."""

from tools.demo.tools import pack

__all__ = ["pack"]
