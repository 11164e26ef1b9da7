"""The review's routes in one router: JSON API (/review/api, and /rollouts), web pages (/review), /export."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.deps import reject_control_characters
from app.review.api import export_router, rollouts_router
from app.review.api import router as api_router
from app.review.ui import pages as ui_pages
from app.review.ui import router as ui_router

_checked = [Depends(reject_control_characters)]

router = APIRouter()
router.include_router(api_router, dependencies=_checked)
router.include_router(export_router, dependencies=_checked)
router.include_router(rollouts_router, dependencies=_checked)
router.include_router(ui_router, dependencies=_checked)
router.include_router(ui_pages, dependencies=_checked)
