"""The code pack's one sandbox per process: chosen at start-up from the settings, built on first use."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tools.code.sandbox import MODES, Containment, Sandbox, SandboxMode, SandboxUnavailable, create, probe

log = logging.getLogger("sparring.packs.code")

UNSAFE_WARNING = (
    "SPARRING_CODE_SANDBOX=unsafe-local: the code pack runs model-written code WITHOUT ISOLATION, as the "
    "server's own user, with its network and files. Use it only for local development, never for training"
)


@dataclass(frozen=True)
class SandboxConfig:
    mode: SandboxMode = "bwrap"
    python: Path | None = None
    home: Path = Path(".sparring")
    containment: Containment = field(default_factory=Containment)


_config = SandboxConfig()
_sandbox: Sandbox | None = None
_lock = threading.Lock()


def configure(
    mode: str,
    *,
    python: Path | None,
    home: Path,
    binds_loopback: bool,
    containment: Containment | None = None,
) -> Sandbox:
    """Build and try the sandbox the settings ask for; SandboxUnavailable says what to install or allow."""
    global _config, _sandbox
    if mode not in MODES:
        raise SandboxUnavailable(f"SPARRING_CODE_SANDBOX must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "unsafe-local":
        if not binds_loopback:
            raise SandboxUnavailable(
                "SPARRING_CODE_SANDBOX=unsafe-local runs code without isolation and is refused on a "
                "non-loopback address; install bubblewrap and use the default bwrap sandbox"
            )
        log.warning(UNSAFE_WARNING)
    config = SandboxConfig(
        mode="bwrap" if mode == "bwrap" else "unsafe-local",
        python=python,
        home=home,
        containment=containment or Containment(),
    )
    sandbox = create(config.mode, python=python, home=home, containment=config.containment)
    asyncio.run(probe(sandbox))
    with _lock:
        previous, (_config, _sandbox) = _sandbox, (config, sandbox)
    if previous is not None:
        previous.close()
    return sandbox


def get_sandbox() -> Sandbox:
    """The configured sandbox (the default bwrap one, built on first use if the server configured none)."""
    global _sandbox
    with _lock:
        if _sandbox is None:
            _sandbox = create(
                _config.mode, python=_config.python, home=_config.home, containment=_config.containment
            )
        return _sandbox
