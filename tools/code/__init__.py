"""The code pack: HumanEval tasks in a per-rollout workspace, sandboxed runs, and the hidden-test grader."""

from tools.code import check as check
from tools.code import dataset as dataset
from tools.code.tools import pack

__all__ = ["pack"]
