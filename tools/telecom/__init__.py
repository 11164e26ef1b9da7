"""The telecom pack: τ²-bench's dual-control telecom environment — the carrier's tools for the agent, the
phone's tools for the simulated user, one state per rollout — with its reward as a grader."""

from tools.telecom import check as check
from tools.telecom import dataset as dataset
from tools.telecom.tools import pack

__all__ = ["pack"]
