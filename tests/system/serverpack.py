"""The pack served by the subprocess servers of the system tests (SPARRING_PACKS=tests.system.serverpack).

The counter of tests/packs.py: `increment` sleeps between its read and its write, so a lost update
between two processes would show; `read_counter` is read-only.
"""

from tests.packs import counter_pack as pack

__all__ = ["pack"]
