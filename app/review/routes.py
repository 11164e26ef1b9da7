"""The review's routes in one router: JSON API (/review/api, and /rollouts), web pages (/review), /export."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.errors import BadRequest
from app.review.api import export_router, rollouts_router
from app.review.api import router as api_router
from app.review.ui import pages as ui_pages
from app.review.ui import router as ui_router

_CONTROL = frozenset(chr(c) for c in range(32)) | {"\x7f"}


def reject_control_characters(request: Request) -> None:
    """A filter or id holding NUL, CR, LF or another control character is a 400.

    No run label, item key, tool, grader, flag, cursor or trace_id the server stores holds one (the
    database cannot hold NUL, a header cannot hold CR or LF), so such a value is a mistake or an attack.
    """
    values = [*request.query_params.values(), *(str(v) for v in request.path_params.values())]
    for value in values:
        if not _CONTROL.isdisjoint(value):
            raise BadRequest("a filter or id contains a control character (NUL, CR, LF, ...)")


_checked = [Depends(reject_control_characters)]

router = APIRouter()
router.include_router(api_router, dependencies=_checked)
router.include_router(export_router, dependencies=_checked)
router.include_router(rollouts_router, dependencies=_checked)
router.include_router(ui_router, dependencies=_checked)
router.include_router(ui_pages, dependencies=_checked)
