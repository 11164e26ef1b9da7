"""The retail pack: τ²-bench's retail customer-service environment as tools, with its database check."""

from tools.retail import check as check
from tools.retail import dataset as dataset
from tools.retail.tools import pack

__all__ = ["pack"]
