"""The airline pack: τ²-bench's airline customer-service environment as tools, with its reward as a grader."""

from tools.airline import check as check
from tools.airline import dataset as dataset
from tools.airline.tools import pack

__all__ = ["pack"]
